#!/bin/bash
# ab.sh TAG BACKEND : runs old and new interleaved
be=$2
args="--backend $be --kernels cpu --batch 1 --heads 4 --lengths 256,512 --head-dim 64 --masks none,causal --paths fused --passes forward,backward --reps 5 --validate-limit 0"
for i in 1 2 3; do
  /tmp/s49/tbase/release/attention-bench $args --json /tmp/s49/$1-old-$i.json > /tmp/s49/$1-old-$i.log 2>&1
  /work/main/target/release/attention-bench $args --json /tmp/s49/$1-new-$i.json > /tmp/s49/$1-new-$i.log 2>&1
done
