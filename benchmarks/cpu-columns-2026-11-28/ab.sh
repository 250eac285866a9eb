#!/bin/bash
# ab.sh OLD_BIN_DIR NEW_BIN_DIR OUT_DIR TAG [attention-bench args...]: runs the kernels before
# (OLD) and after (NEW) interleaved, three rounds, each writing OUT/TAG-{old,new}-N.json.
old=$1; new=$2; out=$3; tag=$4; shift 4
mkdir -p "$out"
for i in 1 2 3; do
  "$old/attention-bench" "$@" --json "$out/$tag-old-$i.json" > "$out/$tag-old-$i.log" 2>&1
  "$new/attention-bench" "$@" --json "$out/$tag-new-$i.json" > "$out/$tag-new-$i.log" 2>&1
done
python3 "$(dirname "$0")/ratio.py" "$out" "$tag"
