# ratio.py DIR: best median per case of old and new over the rounds, old / new (> 1: new faster).
import json, glob, math, sys
d = sys.argv[1]
best = {}
for side in ("old", "new"):
    for f in glob.glob(f"{d}/{side}-*.json"):
        for c in json.load(open(f))["cases"]:
            k = (c["pass"], c["q_len"], c["mask"])
            best.setdefault(side, {})
            best[side][k] = min(best[side].get(k, 1e30), c["median_ms"])
rs = []
for k in sorted(best["old"]):
    r = best["old"][k] / best["new"][k]
    rs.append(r)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {best['old'][k]:.1f} | {best['new'][k]:.1f} | {r:.2f} |")
print("geomean", round(math.exp(sum(map(math.log, rs)) / len(rs)), 3), "range", round(min(rs), 2), round(max(rs), 2))
