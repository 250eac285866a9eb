#!/usr/bin/env bash
# Cold-cache timing of every test binary, per test (libtest --report-time).
set -u
cd /work/main
export GALLIVM_PERF=nopt CARGO_INCREMENTAL=0
OUT=${1:-/tmp/tt/run}
mkdir -p $OUT
cargo test --no-run --message-format=json -p wgpu-attention -p wgpu-attention-transformer -p wgpu-attention-serve -p wgpu-attention-bench 2>/dev/null \
  | python3 -c 'import sys,json
for l in sys.stdin:
  m=json.loads(l)
  if m.get("reason")=="compiler-artifact" and m.get("executable") and m["profile"]["test"]: print(m["target"]["name"], m["executable"], m["manifest_path"])' > $OUT/bins
export MESA_SHADER_CACHE_DIR=$(mktemp -d /tmp/tt/mesa.XXXX)
total0=$(date +%s)
while read name exe manifest; do
  dir=$(dirname $manifest)
  t0=$(date +%s.%N)
  (cd $dir && RUSTC_BOOTSTRAP=1 /usr/bin/time -f "%e %U %S" -o $OUT/$name.time $exe -Z unstable-options --report-time > $OUT/$name.log 2>&1)
  t1=$(date +%s.%N)
  echo "$name $(echo "$t1 - $t0" | bc)" >> $OUT/times
done < $OUT/bins
echo "total $(( $(date +%s) - total0 ))" >> $OUT/times
