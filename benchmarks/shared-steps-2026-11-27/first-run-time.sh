#!/bin/bash
# rtime.sh BIN KERNELS BACKEND PASSES DIM
export GALLIVM_PERF=nopt
d=$(mktemp -d); export MESA_SHADER_CACHE_DIR=$d
s=$(date +%s.%N)
$1 --backend $3 --kernels $2 --batch 1 --heads 1 --lengths 64 --head-dim $5 --masks none --paths fused --passes $4 --reps 1 --validate-limit 0 > /dev/null 2>&1
e=$(date +%s.%N); rm -rf $d
echo "$(echo "$e - $s" | bc)"
