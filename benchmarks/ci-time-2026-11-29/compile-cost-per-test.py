import os,collections,sys
root='/tmp/tt/dump'
ct={}
for f in ['/tmp/tt/ct-vulkan.tsv','/tmp/tt/ct-vulkan2.tsv']:
    if os.path.exists(f):
        for line in open(f):
            l,c,_=line.rstrip('\n').split('\t'); ct[l]=float(c)/1000
use=collections.defaultdict(set); tests=collections.defaultdict(lambda: collections.defaultdict(set))
for b in os.listdir(root):
    for t in os.listdir(f'{root}/{b}'):
        if t.endswith('.log'): continue
        for be in ('vulkan','gl'):
            d=f'{root}/{b}/{t}/{be}'
            if not os.path.isdir(d): continue
            for f in os.listdir(d):
                if f.endswith('.json'):
                    use[(f[:-5],be)].add(f'{b}::{t}'); tests[f'{b}::{t}'][be].add(f[:-5])
est=lambda l: ct.get(l, 1.0)
total=sum(est(l) for (l,be) in use)
print('estimated total compile (vulkan timing for both back ends): %.0f s over %d'%(total,len(use)))
rows=[]
for t,bes in tests.items():
    own=sum(est(l) for be,v in bes.items() for l in v if len(use[(l,be)])==1)
    shared=sum(est(l)/len(use[(l,be)]) for be,v in bes.items() for l in v)
    rows.append((own,shared,t))
rows.sort(reverse=True)
for r in rows[:40]: print('own %6.1f share %6.1f %s'%r)
