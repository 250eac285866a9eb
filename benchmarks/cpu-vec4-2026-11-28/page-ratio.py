# page-ratio.py OLD.json NEW.json: the page's fused forward and backward (web/screenshot.py --bench,
# WebGPU on SwiftShader) before and after, old / new (> 1: new faster).
import json, math, sys
old, new = (json.load(open(p)) for p in sys.argv[1:3])
by_shape = {r["shape"]: r for r in new["runs"]}
rs = []
print("| shape | fwd old ms | new ms | old / new | bwd old ms | new ms | old / new |")
print("|---|---|---|---|---|---|---|")
for r in old["runs"]:
    n = by_shape[r["shape"]]
    f = r["fused_forward_ms"] / n["fused_forward_ms"]
    b = r["fused_backward_ms"] / n["fused_backward_ms"]
    rs += [f, b]
    print(f"| {r['shape']} | {r['fused_forward_ms']:.1f} | {n['fused_forward_ms']:.1f} | {f:.2f} "
          f"| {r['fused_backward_ms']:.1f} | {n['fused_backward_ms']:.1f} | {b:.2f} |")
print("geomean", round(math.exp(sum(map(math.log, rs)) / len(rs)), 3), "range", round(min(rs), 2), round(max(rs), 2))
