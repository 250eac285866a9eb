#!/bin/bash
# ab.sh OLD_BIN NEW_BIN OUT_DIR BACKEND: the CPU-driver family's fused forward and backward,
# the old and new binaries alternated for three rounds (lavapipe's default GALLIVM_PERF).
old=$1; new=$2; out=$3; be=$4; mkdir -p $out
args="--backend $be --kernels cpu --batch 2 --heads 4 --lengths 256,512,1024 --head-dim 64 --masks none,causal --paths fused --passes forward,backward --reps 5 --validate-limit 0"
for i in 1 2 3; do
  $old $args --json $out/old-$i.json > $out/old-$i.log 2>&1
  $new $args --json $out/new-$i.json > $out/new-$i.log 2>&1
done
