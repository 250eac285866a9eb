import json,sys
tag=sys.argv[1]
def cases(p):
    d=json.load(open(p)); return {c['id']:c['median_ms'] for c in d['cases']}
o=[cases(f'/tmp/s49/{tag}-old-{i}.json') for i in (1,2,3)]
n=[cases(f'/tmp/s49/{tag}-new-{i}.json') for i in (1,2,3)]
import math
logs=[]
for k in o[0]:
    old=min(x[k] for x in o); new=min(x[k] for x in n)
    logs.append(math.log(new/old))
    print(f'{k:60s} old {old:8.2f} new {new:8.2f} new/old {new/old:.3f}')
print('geomean new/old', round(math.exp(sum(logs)/len(logs)),3))
