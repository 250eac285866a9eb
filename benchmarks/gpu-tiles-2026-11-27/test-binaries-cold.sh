#!/bin/bash
# Cold-cache timing of the forward and backward test binaries, old (1b1efed) and new (HEAD), alternating.
export GALLIVM_PERF=nopt
cd /work/main
for t in forward backward; do
  for v in old new; do
    d=$(mktemp -d); export MESA_SHADER_CACHE_DIR=$d
    b=$(ls /work/bins/$v/attention_${t}-*)
    s=$(date +%s.%N)
    $b > /work/ab/$t-$v.log 2>&1
    rc=$?
    e=$(date +%s.%N); rm -rf $d
    echo "$t $v rc=$rc $(echo "$e - $s" | bc) s" >> /work/ab/times.txt
  done
done
