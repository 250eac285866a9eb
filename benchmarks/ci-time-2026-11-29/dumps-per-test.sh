#!/usr/bin/env bash
# Per test and back end: which pipelines it compiles (warm cache).
set -u
cd /work/main
export GALLIVM_PERF=nopt MESA_SHADER_CACHE_DIR=$1
OUT=/tmp/tt/dump
while read name exe manifest; do
  case " $BINS " in *" $name "*) ;; *) continue;; esac
  dir=$(dirname $manifest)
  for t in $(cd $dir && $exe --list 2>/dev/null | grep ': test$' | sed 's/: test$//'); do
    for be in vulkan gl; do
      d=$OUT/$name/$t/$be; mkdir -p $d
      (cd $dir && WGPU_ATTENTION_TEST_BACKENDS=$be WGPU_ATTENTION_DUMP_PIPELINES=$d $exe --exact $t --test-threads=1 > $d.log 2>&1)
    done
  done
done < /tmp/tt/base/bins
