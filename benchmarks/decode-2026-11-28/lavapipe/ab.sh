#!/bin/bash
# Interleaved A/B of decode attention on lavapipe: before (5b97fd8) and after, fresh Mesa cache each.
export GALLIVM_PERF=nopt WGPU_BACKEND=vulkan
for r in 1 2; do
  for v in base new; do
    bin=/work/main/target/release/generate-bench; [ $v = base ] && bin=/tmp/gpu-bin-full/generate-bench-base
    export MESA_SHADER_CACHE_DIR=$(mktemp -d)
    s=$(date +%s.%N)
    $bin --layers 1 --prompt 8 --new-tokens 2 --batches 1,8 --heads 8 --attention-lengths 256,1024 --int8 --prefill-attention 0 --reps 3 --json /tmp/lp-$v-$r.json > /tmp/lp-$v-$r.log 2>&1
    e=$(date +%s.%N)
    echo "$v run $r: $(echo "$e - $s" | bc) s"
    rm -rf $MESA_SHADER_CACHE_DIR
  done
done
