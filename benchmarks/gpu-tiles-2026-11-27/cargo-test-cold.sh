#!/bin/bash
# The four crates' cargo test with a cold Mesa cache, each output line stamped with seconds since start.
export GALLIVM_PERF=nopt
d=$(mktemp -d); export MESA_SHADER_CACHE_DIR=$d
cd /work/main
s=$(date +%s)
cargo test -p wgpu-attention -p wgpu-attention-transformer -p wgpu-attention-serve -p wgpu-attention-bench 2>&1 | while IFS= read -r l; do echo "$(( $(date +%s) - s )) $l"; done > /work/ab/suite.log
echo "rc=${PIPESTATUS[0]} total $(( $(date +%s) - s )) s" >> /work/ab/suite.log
rm -rf $d
