#!/bin/bash
# GPU family on lavapipe and llvmpipe GL, 269d2d2 (mid) and this change (fin) interleaved, two rounds.
export GALLIVM_PERF=nopt
for be in vulkan gl; do
 args="--backend $be --kernels gpu --batch 1 --heads 4 --lengths 256 --head-dim 64 --masks none,causal --paths fused --passes forward,backward --reps 5 --validate-limit 0"
 for i in 1 2; do
  /work/tgt-mid/release/attention-bench $args --json /work/ab/gpu-$be-mid-$i.json > /dev/null 2>&1
  /work/main/target/release/attention-bench $args --json /work/ab/gpu-$be-fin-$i.json > /dev/null 2>&1
 done
done
echo done > /work/ab/ab-gpu.done
