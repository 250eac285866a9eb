#!/usr/bin/env bash
# Cold runs of test binaries built before and after the per-context test lock, one after another:
# lock-ab.sh DIR NAME... (each DIR/NAME an attention test binary), a fresh Mesa shader cache each,
# GALLIVM_PERF=nopt as CI sets it, run from the engine's root as cargo runs them.
set -euo pipefail
dir=$1; shift
cd "$(dirname "$0")/../.."
export GALLIVM_PERF=nopt
for name in "$@"; do
    cache=$(mktemp -d)
    start=$(date +%s.%N)
    MESA_SHADER_CACHE_DIR=$cache /usr/bin/time -f "$name wall %e s user %U s sys %S s" \
        "$dir/$name" -q > "$dir/$name.log" 2>&1 || echo "$name FAILED"
    tail -1 "$dir/$name.log"
    grep "test result" "$dir/$name.log" || true
    rm -rf "$cache"
done
