import json,sys,glob,statistics,os
d=sys.argv[1]; names=sys.argv[2:]
res={}
for n in names:
    for f in sorted(glob.glob(f'{d}/{n}-*.json')):
        for r in json.load(open(f))['decode_attention']:
            k=(r['batch'],r['heads'],r['kv_heads'],r['head_dim'],r['format'],r.get('page'),r['cache_len'])
            res.setdefault(k,{}).setdefault(n,[]).append(r['ms'])
for k,v in sorted(res.items()):
    meds={n:statistics.median(v[n]) for n in names if n in v}
    base=meds[names[0]]
    print(k, ' '.join('%s %.2f (%.2fx)'%(n,meds[n],base/meds[n]) for n in names if n in meds))
