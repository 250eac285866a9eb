#!/usr/bin/env bash
# lavapipe: the fused CPU-driver kernels with the flags from the uniform (base) and fixed by override
# constants (fixed), interleaved twice, each with its JSON report.
B=${BENCH:-target/release/attention-bench}
out=${OUT:-.}
common="--batch 1 --heads 8 --lengths 512 --head-dim 64 --paths fused --passes forward,backward --reps 7 --backend vulkan"
for round in 1 2; do
  for mode in base fixed; do
    for case in "none 0 --masks none" "softcap 8 --masks none --modifiers softcap"; do
      set -- $case; name=$1; fixed=$2; shift 2
      env=()
      [[ $mode == fixed ]] && env=(WGPU_ATTENTION_FIXED_FLAGS=4095:$fixed)
      env "${env[@]}" $B $common "$@" --json $out/lavapipe-$name-$mode-$round.json > $out/lavapipe-$name-$mode-$round.txt 2>&1
    done
  done
done
