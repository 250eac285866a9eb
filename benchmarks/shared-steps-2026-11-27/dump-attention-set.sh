#!/bin/bash
# usage: dump.sh BIN_DIR OUT_DIR
BIN=$1; OUT=$2; rm -rf $OUT; mkdir -p $OUT
export WGPU_ATTENTION_DUMP_PIPELINES=$OUT
run() { "$BIN/attention-bench" --compile-only --batch 1 --heads 2 --lengths 64 "$@" > /dev/null 2>>$OUT.log || echo "FAIL $*"; }
for be in vulkan gl; do
 for d in 32 64 128; do
  run --backend $be --kernels cpu,gpu --head-dim $d --masks none,causal,varlen --modifiers none,relative,softcap,bias --passes forward,backward
 done
 run --backend $be --kernels cpu,gpu --head-dim 64 --head-dim-v 32 --masks none,causal --passes forward,backward
 run --backend $be --kernels cpu,gpu --head-dim 40 --masks causal --passes forward,backward
done
run --backend vulkan --kernels gpu --dtypes f16 --head-dim 64 --masks none,causal --passes forward,backward
ls $OUT/*.wgsl | wc -l
