# ratio.py OUT TAG: per case, the best of three rounds before and after, and their ratio.
import json, math, sys

out, tag = sys.argv[1], sys.argv[2]


def cases(path):
    return {c["id"]: c["median_ms"] for c in json.load(open(path))["cases"]}


old = [cases(f"{out}/{tag}-old-{i}.json") for i in (1, 2, 3)]
new = [cases(f"{out}/{tag}-new-{i}.json") for i in (1, 2, 3)]
logs = []
for k in old[0]:
    o = min(x[k] for x in old)
    n = min(x[k] for x in new)
    logs.append(math.log(n / o))
    print(f"{k:60s} old {o:8.2f} new {n:8.2f} old/new {o / n:.3f}")
print("geomean old/new", round(math.exp(-sum(logs) / len(logs)), 3))
