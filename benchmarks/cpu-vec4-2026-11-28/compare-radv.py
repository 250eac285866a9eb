# compare-radv.py OLD.json NEW.json: gpu-compile-report rows of the same pipelines before and after,
# the new CPU-driver labels' "-VEC41" (the vec4 build, which every view of the dump set takes)
# dropped to match the old labels. Prints the rows that differ in any statistic.
import json, sys

KEYS = ['VGPRs', 'Pre-Sched VGPRs', 'Spilled VGPRs', 'Scratch size', 'LDS size',
        'Subgroups per SIMD', 'Instructions', 'Inverse Throughput', 'Code size']

def load(path, strip):
    rows = {}
    for r in json.load(open(path)):
        name = r['name']
        if strip and '_cpu' in name:
            name = name.replace('-VEC41', '')
        rows[(name, r['chip'])] = r['driver_statistics']
    return rows

old, new = load(sys.argv[1], False), load(sys.argv[2], True)
same, rows = 0, []
for k in sorted(old):
    if k not in new:
        print('missing after:', k)
        continue
    a, b = old[k], new[k]
    if all(a[x] == b[x] for x in KEYS):
        same += 1
        continue
    rows.append((k[0], k[1], b['Instructions'] / a['Instructions'],
                 b['Inverse Throughput'] / a['Inverse Throughput'], a['VGPRs'], b['VGPRs'],
                 a['Spilled VGPRs'], b['Spilled VGPRs'], a['Scratch size'], b['Scratch size'],
                 a['Subgroups per SIMD'], b['Subgroups per SIMD']))
print(f'{len(old)} pipeline x chip rows: {same} identical in every statistic')
for r in rows:
    print('%-80s %-8s instr %.3f invthr %.3f VGPR %d->%d spill %d->%d scratch %d->%d waves %d->%d' % r)
