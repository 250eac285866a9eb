# compare-radv.py OLD.json NEW.json: gpu-compile-report rows of the CPU-driver backward pipelines
# before and after, matched by label without the step (STEP_QUADSn) and the staged tile's rows
# (BLOCK_Mn: whole steps now), which the change set. One line per pipeline x chip.
import json, re, sys

def load(path):
    rows = {}
    for r in json.load(open(path)):
        name = re.sub(r'-STEP_QUADS\d+', '', r['name'])
        name = re.sub(r'-BLOCK_M\d+', '', name)
        rows[(name, r['chip'])] = (r['name'], r['driver_statistics'])
    return rows

old, new = load(sys.argv[1]), load(sys.argv[2])
for k in sorted(old):
    if k not in new:
        print('missing after:', k)
        continue
    (_, a), (label, b) = old[k], new[k]
    print('%-100s %-8s VGPR %3d->%3d spill %3d->%3d scratch %6d->%6d LDS %6d->%6d waves %2d->%2d instr %.2fx invthr %.2fx' % (
        label, k[1], a['VGPRs'], b['VGPRs'], a['Spilled VGPRs'], b['Spilled VGPRs'],
        a['Scratch size'], b['Scratch size'], a['LDS size'], b['LDS size'],
        a['Subgroups per SIMD'], b['Subgroups per SIMD'],
        b['Instructions'] / a['Instructions'], b['Inverse Throughput'] / a['Inverse Throughput']))
