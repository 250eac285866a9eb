import collections,math
t=collections.defaultdict(dict)
for l in open('/work/ab/first-use.txt'):
    p=[x.strip() for x in l.split('|')]
    if len(p)<4: continue
    t[(p[0],p[1])][p[2]]=float(p[3])
cfg=collections.defaultdict(lambda: collections.defaultdict(list))
for (rep,c),d in t.items():
    for v,x in d.items(): cfg[c][v].append(x)
tot={'old':0,'mid':0,'new':0}
lr={'mid/old':[], 'new/mid':[]}
for c,d in cfg.items():
    m={v:sum(x)/len(x) for v,x in d.items()}
    for v in m: tot[v]+=m[v]
    lr['mid/old'].append(math.log(m['mid']/m['old'])); lr['new/mid'].append(math.log(m['new']/m['mid']))
    print(f"{c:42s} old {m['old']:6.2f} mid {m['mid']:6.2f} new {m['new']:6.2f}")
print('totals', {k:round(v,1) for k,v in tot.items()})
for k,v in lr.items(): print(k,'geomean %.3f'%math.exp(sum(v)/len(v)))
