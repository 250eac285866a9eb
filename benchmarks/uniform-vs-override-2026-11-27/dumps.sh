#!/usr/bin/env bash
# Dumps the fused pipelines of each case with the flags read from the uniform (base) and fixed by
# override constants (fixed), for RADV.
B=${BENCH:-target/release/attention-bench}
common="--compile-only --batch 1 --heads 8 --lengths 256 --head-dim 64 --paths fused --passes forward,backward --kernels cpu,gpu --backend vulkan"
run() { # name fixed args...
  local name=$1 fixed=$2; shift 2
  WGPU_ATTENTION_DUMP_PIPELINES=${OUT:-.}/$name-base $B $common "$@" > ${OUT:-.}/$name-base.log 2>&1
  WGPU_ATTENTION_FIXED_FLAGS=4095:$fixed WGPU_ATTENTION_DUMP_PIPELINES=${OUT:-.}/$name-fixed $B $common "$@" > ${OUT:-.}/$name-fixed.log 2>&1
}
run none 0 --masks none
run causal 1 --masks causal
run softcap 8 --masks none --modifiers softcap
