#!/bin/bash
# iter.sh NAME: build the working tree's bench, dump the GPU backward/forward at D32, 40, 128 and 64/32, RADV them, compare with mid's rows.
N=$1; OUT=/work/radv/it-$N; rm -rf $OUT; mkdir -p $OUT
cd /work/main && cargo build --release -p wgpu-attention-bench --bin attention-bench 2>&1 | tail -1
export WGPU_ATTENTION_DUMP_PIPELINES=$OUT
B=/work/main/target/release/attention-bench
for d in 32 40 128; do $B --compile-only --backend vulkan --kernels gpu --batch 1 --heads 2 --lengths 64 --head-dim $d --masks causal --passes forward,backward > /dev/null 2>&1; done
$B --compile-only --backend vulkan --kernels gpu --batch 1 --heads 2 --lengths 64 --head-dim 64 --head-dim-v 32 --masks causal --passes forward,backward > /dev/null 2>&1
$B --compile-only --backend vulkan --kernels gpu --batch 1 --heads 2 --lengths 64 --head-dim 64 --masks causal --passes forward,backward > /dev/null 2>&1
rm -f $OUT/*preprocess* $OUT/*merge* 
cd /work/shared/tools/gpu-compile-report && ./run $OUT --chips gfx1100,navi21 --json $OUT.json > $OUT.report 2>&1
python3 - $OUT.json <<'PY'
import json,sys
a={(r['name'],r['chip']):r for r in json.load(open('/work/radv/mid.json'))}
b={(r['name'],r['chip']):r for r in json.load(open(sys.argv[1]))}
for k in sorted(b):
    if k not in a: print('missing in mid', k); continue
    da=a[k]['driver_statistics']; db=b[k]['driver_statistics']
    print('%-84s %-8s instr %.3f invthr %.3f VGPR %d->%d spill %d->%d'%(k[0][:84],k[1],db['Instructions']/da['Instructions'],db['Inverse Throughput']/da['Inverse Throughput'],da['VGPRs'],db['VGPRs'],da['Spilled VGPRs'],db['Spilled VGPRs']))
PY
