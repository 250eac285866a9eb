#!/bin/bash
BIN=$1; OUT=$2; rm -rf $OUT; mkdir -p $OUT
export WGPU_ATTENTION_DUMP_PIPELINES=$OUT
for be in vulkan gl; do
  WGPU_BACKEND=$be "$BIN/transformer-bench" --compile-only > /dev/null 2>>$OUT.log || echo "FAIL transformer $be"
  WGPU_BACKEND=$be "$BIN/transformer-bench" --compile-only --varlen > /dev/null 2>>$OUT.log || echo "FAIL transformer varlen $be"
  WGPU_BACKEND=$be "$BIN/generate-bench" --compile-only > /dev/null 2>>$OUT.log || echo "FAIL generate $be"
  "$BIN/additive-bench" --compile-only --backend $be > /dev/null 2>>$OUT.log || echo "FAIL additive $be"
done
WGPU_ATTENTION_KERNELS=gpu "$BIN/generate-bench" --compile-only > /dev/null 2>>$OUT.log || echo "FAIL generate gpu"
WGPU_ATTENTION_KERNELS=gpu "$BIN/transformer-bench" --compile-only > /dev/null 2>>$OUT.log || echo "FAIL transformer gpu"
ls $OUT/*.wgsl | wc -l
