# compare-radv.py BASE.json VEC4.json SOFT.json: gpu-compile-report rows of the decode pipelines at
# 3dd6c84 (base), with vec4 reads (vec4) and with the softmax on every invocation as well (soft),
# matched by label without VEC41, grouped by path (staged or read in place) and read (vec4 or
# word): ranges of VGPRs, waves and LDS, scratch, rows with fewer waves, ACO's latency estimate.
import json, re, sys

def load(path):
    rows = {}
    for r in json.load(open(path) if not path.endswith('.gz') else __import__('gzip').open(path)):
        rows[(re.sub(r'-VEC41', '', r['name']), r['chip'])] = r
    return rows

base, vec4, soft = (load(p) for p in sys.argv[1:4])
groups = {}
for k in base:
    path = 'in place' if 'STAGED0' in k[0] else 'staged'
    read = 'vec4' if 'VEC41' in soft[k]['name'] else 'word'
    stats = [x[k]['driver_statistics'] for x in (base, vec4, soft)]
    groups.setdefault((path, read, k[1]), []).append(stats)
for g, rows in sorted(groups.items()):
    def span(field, i):
        values = [r[i][field] for r in rows]
        return '%d-%d' % (min(values), max(values))
    lat = [r[2]['Latency'] / r[0]['Latency'] for r in rows]
    scratch = sum(r[2]['Scratch size'] + r[2]['Spilled VGPRs'] + r[2]['Spilled SGPRs'] for r in rows)
    fewer = sum(r[2]['Subgroups per SIMD'] < r[0]['Subgroups per SIMD'] for r in rows)
    print('| %s | %s | %s | %d | %s / %s / %s | %s / %s | %s / %s | %d | %d | %.2f-%.2f |' % (
        g[0], g[1], g[2], len(rows), span('VGPRs', 0), span('VGPRs', 1), span('VGPRs', 2),
        span('Subgroups per SIMD', 0), span('Subgroups per SIMD', 2), span('LDS size', 0),
        span('LDS size', 2), scratch, fewer, min(lat), max(lat)))
