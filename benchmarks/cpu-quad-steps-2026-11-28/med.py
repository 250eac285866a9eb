# med.py OUT BASE: per case (and per backward pass), the median and best of every build's rounds in
# OUT (abn.sh), and BASE's median over each other build's.
import json, sys, glob, collections, re, statistics
out = sys.argv[1]; base = sys.argv[2]
res = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(f"{out}/*.json")):
    name = re.sub(r"-\d+\.json$", "", f.split("/")[-1])
    for c in json.load(open(f))["cases"]:
        res[c["id"]][name].append(c["median_ms"])
        for p in c.get("profile") or []:
            if "preprocess" not in p["label"]:
                res[c["id"] + " : " + p["label"].replace("attention_backward_", "")][name].append(p["ms"])
names = sorted({n for v in res.values() for n in v})
print("| case | " + " | ".join(f"{n} median (best)" for n in names) + " | " + " | ".join(f"{base}/{n} median" for n in names if n != base) + " |")
print("|---" * (1 + 2 * len(names) - 1) + "|")
for k, v in res.items():
    cells = [f"{statistics.median(v[n]):.0f} ({min(v[n]):.0f})" for n in names]
    ratios = [f"{statistics.median(v[base]) / statistics.median(v[n]):.2f}" for n in names if n != base]
    print(f"| {k.replace('fused-cpu ', '')} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
