#!/bin/bash
# First use (compile + a few runs) of one fused case on a cold Mesa cache, GALLIVM_PERF=nopt, for the
# three builds interleaved: old (1b1efed), mid (269d2d2), new (working tree).
export GALLIVM_PERF=nopt
declare -A BIN=([old]=/work/tgt-old/release/attention-bench [mid]=/work/tgt-mid/release/attention-bench [new]=/work/main/target/release/attention-bench)
configs=(
 "vulkan cpu forward 64 none none"
 "vulkan cpu backward 64 causal none"
 "vulkan gpu forward 64 causal none"
 "vulkan gpu backward 64 causal none"
 "vulkan cpu backward 32 causal relative"
 "vulkan gpu backward 32 causal relative"
 "gl cpu forward 64 none none"
 "gl cpu backward 64 causal none"
 "gl gpu forward 64 causal none"
 "gl gpu backward 64 causal none"
)
for rep in 1 2; do
 for cfg in "${configs[@]}"; do
  set -- $cfg
  for v in old mid new; do
   d=$(mktemp -d); export MESA_SHADER_CACHE_DIR=$d
   s=$(date +%s.%N)
   ${BIN[$v]} --backend $1 --kernels $2 --batch 1 --heads 2 --lengths 64 --head-dim $4 --masks $5 --modifiers $6 --paths fused --passes $3 --reps 1 --validate-limit 0 > /dev/null 2>>/work/ab/first-use.err || echo "FAIL $v $cfg" >> /work/ab/first-use.err
   e=$(date +%s.%N); rm -rf $d
   echo "$rep | $cfg | $v | $(echo "$e - $s" | bc)" >> /work/ab/first-use.txt
  done
 done
done
echo done >> /work/ab/first-use.txt
