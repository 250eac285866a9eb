#!/bin/bash
# Each binary is an attention-bench build; every round runs each once, in order, writing OUT/NAME-ROUND.json.
# abn.sh OUT ROUNDS BIN... -- args : runs the binaries in rotation
out=$1; rounds=$2; shift 2
bins=(); while [ "$1" != "--" ]; do bins+=("$1"); shift; done; shift
mkdir -p $out
for i in $(seq 1 $rounds); do for b in "${bins[@]}"; do
  n=$(basename $b); "$b" "$@" --json "$out/$n-$i.json" > "$out/$n-$i.log" 2>&1
done; done
