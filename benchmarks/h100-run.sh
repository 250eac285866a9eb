#!/bin/bash
# One device call on the H100 (prepare with benchmarks/h100-bundle.sh): the loader and stripped release binaries travel as .gl/ and
# .gpu/bundle.tar.xz (see ../shared/GPU.md); every report goes to $OUT. Each step has its own time
# limit so one slow step cannot lose the others' reports.
set -u
# The device tool brings back only a few files from $OUT: every report goes to a staging folder,
# packed into $OUT/reports.tar.xz when the script ends (also when a step's timeout or BUDGET_S, the
# seconds this call may use, stops it early; keep BUDGET_S under the call's timeout_s).
REPORTS_OUT=$OUT
OUT=$(mktemp -d)
pack() { tar -C "$OUT" -cJf "$REPORTS_OUT/reports.tar.xz" . && ls -la "$REPORTS_OUT/reports.tar.xz"; }
trap pack EXIT
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
[ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
tar -C .gpu -xJf .gpu/bundle.tar.xz
B=.gpu/bin
export WGPU_BACKEND=vulkan
step() {
  local limit=$1 name=$2; shift 2
  if [ $((SECONDS + limit)) -gt $DEADLINE ]; then echo "== $name skipped: BUDGET_S left $((DEADLINE - SECONDS)) s"; return; fi
  echo "== $name ($(date +%T))"; timeout $limit "$@" > $OUT/$name.log 2>&1; echo "   rc $? $(date +%T)"
}
vulkaninfo --summary > $OUT/vulkaninfo.log 2>&1
# Per-step plan comes from $PLAN (a list of step names: dump coop sweep suite64 suite128 cpu64 gemm
# transformer trusted generate additive burn tests, and the shorter coop44 coopsweep coop64 sweepfwd transformer1 tests-core tests-coop gemmcoop flags atomicdq decodeattn decodegrid decodeab prefillpaged serve tests-decode tune tunetc mixed) so later calls can pick.
for s in ${PLAN:-sweep suite64 suite128 cpu64 gemm transformer tests}; do
  case $s in
  dump)
    # Every pipeline the GPU suite, a training step and a decoding step build, with the shapes this
    # GPU's limits choose: brought back in $OUT/dump.tar.xz, compiled here for AMD chips with
    # ../shared/tools/gpu-compile-report (RADV), which cannot run on the GPU machine.
    export WGPU_ATTENTION_DUMP_PIPELINES=/tmp/dump
    step 60 dump-suite $B/attention-bench --compile-only --suite gpu --kernels gpu,coop --dtypes f32,f16 \
      --modifiers none,softcap,alibi,softcap-alibi,bias,relative,sinks,cosine,clip
    for a in "" "--additive 64"; do
      WGPU_ATTENTION_KERNELS=gpu step 30 dump-train${a:+-additive} $B/transformer-bench --compile-only $a
      WGPU_ATTENTION_KERNELS=gpu step 30 dump-decode${a:+-additive} $B/generate-bench --compile-only ${a:---page 16 --f16 --int8}
    done
    unset WGPU_ATTENTION_DUMP_PIPELINES
    tar -C /tmp -cJf $OUT/dump.tar.xz dump ;;
  decode)
    # The decoding step after the split-k SKINNY GEMM and the workgroup-per-row LayerNorm (both new
    # since the 2026-11-26 H200 run: 8.17 ms per step at batch 1), with GPU time per kernel
    # (--profile), and a training step's split by family.
    step 120 generate $B/generate-bench --page 16 --profile --json $OUT/h100-generate.json
    step 60 transformer $B/transformer-bench --reps 10 --json $OUT/h100-transformer.json ;;
  decodeattn)
    # Issue 46: decode attention's K/V read bandwidth against a copy's in the same run (H 32 / Hkv
    # 8, D 64, one query per sequence, f32 and int8 caches, contexts 2k-16k, batch 1-32); with
    # generate-bench-base, the kernel before a change, when the bundle carries it, and the decode
    # shapes (WGPU_ATTENTION_DECODE=KEYSxWORKGROUPS) in $DECODE_SHAPES. Generation itself is cut to
    # one layer and two tokens.
    args=(--layers 1 --prompt 8 --new-tokens 2 --batches 1,8,32 --heads 32 --attention-lengths 2048,8192,16384
      --int8 --prefill-attention 0 --reps 5)
    for g in generate-bench generate-bench-base; do
      [ -x $B/$g ] && step 90 decodeattn-$g $B/$g "${args[@]}" --json $OUT/decodeattn-$g.json
    done
    for shape in ${DECODE_SHAPES:-}; do
      WGPU_ATTENTION_DECODE=$shape step 90 decodeattn-$shape $B/generate-bench "${args[@]}" --json $OUT/decodeattn-$shape.json
    done
    # The runtime checks' cost ($DECODE_TRUSTED: noloop drops wgpu's loop counters, all every check).
    for tr in ${DECODE_TRUSTED:-}; do
      for g in generate-bench generate-bench-base; do
        [ -x $B/$g ] && WGPU_ATTENTION_TRUSTED_SHADERS=$tr step 90 decodeattn-$g-$tr $B/$g "${args[@]}" \
          --json $OUT/decodeattn-$g-$tr.json
      done
    done ;;
  decodegrid)
    # Issue 46 item 2: decode attention's K/V read bandwidth over the grid (contexts 1k-32k, batch
    # 1/8/64, GQA 32/8 and 8/2, D 64 and 128, f32, f16 and int8, contiguous and paged in blocks of
    # 16) against the copy kernel's and a buffer copy's bandwidth of the same bytes in the same run
    # (288 cases, caches over the binding limit skipped and listed).
    step 400 decodegrid $B/generate-bench --decode-attention --attention-lengths 1024,4096,16384,32768 \
      --batches 1,8,64 --attention-heads 32/8,8/2 --attention-head-dims 64,128 --f16 --int8 --page 16 \
      --reps 5 --json $OUT/decodegrid.json ;;
  prefillpaged)
    # Issue 46's paged prefill (the fused forward reading the pools through the block table) against
    # the contiguous one, same tensors, prompts 512 and 2048, batch 1 and 8 (target: within 1.2x),
    # and the same prefill over f16 and int8 caches, contiguous and paged (dequantised as staged).
    step 120 prefillpaged $B/generate-bench --layers 1 --prompt 8 --new-tokens 2 --batches 1,8 \
      --attention-lengths 0 --prefill-attention 512,2048 --page 16 --f16 --int8 --reps 5 \
      --json $OUT/prefillpaged.json ;;
  decodeab)
    # Issue 46's decode kernel against the one before (generate-bench-base, from the bundle's
    # BASE=3dd6c84: word-per-access reads, the softmax walked by one invocation per row, int8 read
    # in place where it is now staged) on a
    # smaller grid, two interleaved rounds: contexts 4k and 16k, batch 1/8/64, H 32 / Hkv 8, D 64
    # and 128, f32 and int8.
    for r in 1 2; do
      for g in generate-bench generate-bench-base; do
        [ -x $B/$g ] && step 90 decodeab-$g-$r $B/$g --decode-attention --attention-lengths 4096,16384 \
          --batches 1,8,64 --attention-heads 32/8 --attention-head-dims 64,128 --int8 --reps 5 \
          --json $OUT/decodeab-$g-$r.json
      done
    done ;;
  decodesteps)
    # Decoding end to end (decoder-only d_model 512, 8 layers, prompt 512, contiguous and paged
    # caches, GPU time per kernel) with the decode kernel now and before the change.
    for g in generate-bench generate-bench-base; do
      [ -x $B/$g ] && step 90 decodesteps-$g $B/$g --page 16 --profile --attention-lengths 0 \
        --prefill-attention 0 --json $OUT/decodesteps-$g.json
    done ;;
  serve)
    # Issue 46's third target: the server example's tokens/s at 32 slots against 1 (a random
    # LLaMA-style model, d 256, 4 layers, 8 heads over 2 KV heads; paged f32 cache, then int8),
    # 64 requests of 128-token prompts and 64 new tokens, one arriving every round.
    for c in "" "--int8"; do
      for slots in 1 32; do
        step 60 serve-$slots${c:+-int8} $B/serve --slots $slots --requests 64 --arrive-every 1 \
          --prompt 128 --max-new-tokens 64 $c
      done
    done ;;
  tests-decode)
    # Decode attention and generation (contiguous, paged, int8, f16, trees, the server; prefill on
    # the fused forward through block tables and cache words) on the device.
    for t in attention_decode generation paged_cache nan; do
      [ -x $B/test_$t ] && WGPU_ATTENTION_TEST_BACKENDS=vulkan step 90 test-$t $B/test_$t
    done ;;
  flags)
    # Issue 49's flags, in the library's form since 2026-11-28: the GPU and tensor-core families'
    # backward with their fixed-flag builds (unmasked and causal calls) against the builds that read
    # the flags from the uniform (WGPU_ATTENTION_FIXED_FLAG_BUILDS=off), f16, B1 H8 D64 L 4096, two
    # interleaved pairs. The experiment binary measured the GPU family's causal backward at 0.53x.
    for r in 1 2; do
      for mode in on off; do
        WGPU_ATTENTION_FIXED_FLAG_BUILDS=$mode step 60 flags-$mode-$r $B/attention-bench --kernels gpu,coop \
          --dtypes f16 --batch 1 --heads 8 --head-dim 64 --lengths 4096 --masks none,causal \
          --passes backward --paths fused --reps 5 --json $OUT/flags-$mode-$r.json
      done
    done ;;
  atomicdq)
    # Issues 44 and 45's backward at FlashAttention-2's split: the GPU and tensor-core families'
    # dK/dV kernels adding dQ with f32 atomics (--atomic-gradients) against the dK/dV + dQ kernels,
    # f32 and f16, B1 H8 D64 and B4 H16 D128, L 1024 (validated) to 8192, none and causal; forward
    # and backward in one run each (the backward/forward ratio is the target), two interleaved pairs
    # at D 64. About 4 minutes. First the atomic tests on the device (the tensor-core build's
    # cooperative-matrix sums run nowhere else), last a training step with atomics.
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-atomicdq $B/test_attention_backward atomic
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 30 test-atomicdq-nan $B/test_nan atomic
    for r in 1 2; do
      for mode in kernel atomic; do
        a=""; [ $mode = atomic ] && a=--atomic-gradients
        step 100 atomicdq-$mode-d64-$r $B/attention-bench --kernels gpu,coop --dtypes f32,f16 --batch 1 --heads 8 \
          --head-dim 64 --lengths 1024,4096,8192 --masks none,causal --passes forward,backward --paths fused \
          --reps 5 $a --json $OUT/atomicdq-$mode-d64-$r.json
      done
    done
    for mode in kernel atomic; do
      a=""; [ $mode = atomic ] && a=--atomic-gradients
      step 80 atomicdq-$mode-d128 $B/attention-bench --kernels gpu,coop --dtypes f16 --batch 4 --heads 16 \
        --head-dim 128 --lengths 1024,4096 --masks none,causal --passes forward,backward --paths fused \
        --reps 5 $a --json $OUT/atomicdq-$mode-d128.json
    done
    WGPU_ATTENTION_ATOMIC_GRADIENTS=on step 60 atomicdq-transformer $B/transformer-bench \
      --precision f32,mixed --reps 10 --json $OUT/atomicdq-transformer.json ;;
  coop64)
    step 120 coop-b1h8d64 $B/attention-bench --kernels gpu,coop --dtypes f16,f32 --batch 1 --heads 8 \
      --head-dim 64 --lengths 1024,4096,8192 --masks none,causal --passes forward,backward --paths fused \
      --reps 5 --json $OUT/h100-coop-b1h8d64.json ;;
  coop44)
    # Issue 44's step (under 6 minutes): the tensor-core family's forward against the GPU family's,
    # f16 and f32, none and causal, fused against unfused at B1 H8 D64; burn 0.22's flash attention
    # in the same call; then the tensor-core backward against the GPU family's at D 64 and 128,
    # with each case's dK/dV and dQ kernels timed apart (--profile).
    step 150 coop44-fwd-b1h8d64 $B/attention-bench --kernels gpu,coop --dtypes f16,f32 --batch 1 --heads 8 \
      --head-dim 64 --lengths 1024,2048,4096,8192,16384 --masks none,causal --passes forward \
      --paths fused,unfused --reps 3 --json $OUT/coop44-fwd-b1h8d64.json
    step 120 coop44-fwd-b4h16d128 $B/attention-bench --kernels gpu,coop --dtypes f16,f32 --batch 4 --heads 16 \
      --head-dim 128 --lengths 1024,2048,4096,8192 --masks none,causal --passes forward --paths fused \
      --reps 3 --json $OUT/coop44-fwd-b4h16d128.json
    # Inside burn the op gets burn's device without its adapter, so the tensor-core build cannot
    # qualify there (it would run the portable build): the GPU family is what burn users get.
    step 90 coop44-burn $B/burn-bench --batch 1 --heads 8 --head-dim 64 --family gpu --lengths 1024,2048,4096 \
      --reps 3
    step 120 coop44-bwd-b1h8d64 $B/attention-bench --kernels gpu,coop --dtypes f16,f32 --batch 1 --heads 8 \
      --head-dim 64 --lengths 1024,4096,8192 --masks none,causal --passes forward,backward --paths fused \
      --reps 3 --profile --json $OUT/coop44-bwd-b1h8d64.json
    step 90 coop44-bwd-b4h16d128 $B/attention-bench --kernels gpu,coop --dtypes f16 --batch 4 --heads 16 \
      --head-dim 128 --lengths 1024,4096 --masks none,causal --passes forward,backward --paths fused \
      --reps 3 --profile --json $OUT/coop44-bwd-b4h16d128.json ;;
  coopsweep)
    # The tensor-core forward's shapes (WGPU_ATTENTION_COOP_FORWARD=GROUPSxBN), f16 at L 4096.
    for cfg in 4x64 4x32 2x64 2x32 1x64; do
      WGPU_ATTENTION_COOP_FORWARD=$cfg step 25 coopsweep-d64-$cfg $B/attention-bench --kernels coop --dtypes f16 --batch 1 --heads 8 \
        --head-dim 64 --lengths 4096 --masks none --passes forward --paths fused --reps 5 --validate-limit 0 --json $OUT/coopsweep-d64-$cfg.json
    done
    for cfg in 4x32 2x32 1x64 4x16; do
      WGPU_ATTENTION_COOP_FORWARD=$cfg step 25 coopsweep-d128-$cfg $B/attention-bench --kernels coop --dtypes f16 --batch 4 --heads 16 \
        --head-dim 128 --lengths 4096 --masks none --passes forward --paths fused --reps 5 --validate-limit 0 --json $OUT/coopsweep-d128-$cfg.json
    done ;;
  sweepfwd)
    for cfg in 128x64x32 64x64x32 256x64x32 128x32x32 64x32x32 128x64x16; do
      WGPU_ATTENTION_TILED_FORWARD=$cfg step 25 sweep-fwd-$cfg $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 4096 --masks none --passes forward --paths fused --reps 5 --validate-limit 0 --json $OUT/sweep-fwd-$cfg.json
    done ;;
  sweepbwd)
    # The backward's tile shapes (B1 H8 D64; L 1024 is validated against the reference): dK/dV, then dQ.
    for cfg in 128x32x32 256x32x32 64x16x32; do
      WGPU_ATTENTION_TILED_DKDV=$cfg step 30 sweep-dkdv-$cfg $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 1024,4096 --masks none --passes backward --paths fused --reps 3 --json $OUT/sweep-dkdv-$cfg.json
    done
    for cfg in 128x32x32 256x32x32 64x16x32; do
      WGPU_ATTENTION_TILED_DQ=$cfg step 30 sweep-dq-$cfg $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 1024,4096 --masks none --passes backward --paths fused --reps 3 --json $OUT/sweep-dq-$cfg.json
    done ;;
  transformer1)
    step 60 transformer $B/transformer-bench --reps 10 --json $OUT/h100-transformer.json ;;
  tests-coop)
    # The tensor-core family's backward test on the device (its cooperative build where it qualifies).
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 120 test-coop-backward $B/test_attention_backward tensor_core_family_backward ;;
  tests-core)
    # 120 s: on the H100 the backward's tests outran 60 s compiling into a cold driver cache (6.95 s warm).
    for t in attention_forward attention_backward training; do
      WGPU_ATTENTION_TEST_BACKENDS=vulkan step 120 test-$t $B/test_$t
    done ;;
  coop)
    # The tensor-core family: which build the device qualifies (the report's kernel column), its speed and
    # accuracy against the GPU family in f16 and f32.
    step 150 coop-b1h8d64 $B/attention-bench --kernels gpu,coop --dtypes f16,f32 --batch 1 --heads 8 \
      --head-dim 64 --lengths 1024,2048,4096,8192 --masks none,causal --passes forward,backward --paths fused \
      --reps 5 --json $OUT/h100-coop-b1h8d64.json
    step 150 coop-b4h16d128 $B/attention-bench --kernels gpu,coop --dtypes f16 --batch 4 --heads 16 --head-dim 128 \
      --lengths 1024,2048,4096 --masks none,causal --passes forward --paths fused --reps 3 \
      --json $OUT/h100-coop-b4h16d128.json ;;
  sweep)
    for cfg in 128x64x32 64x64x32 256x64x32 128x32x32 64x32x32 128x64x16; do
      WGPU_ATTENTION_TILED_FORWARD=$cfg step 40 sweep-fwd-$cfg $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 1024,4096 --masks none --passes forward --paths fused --reps 5 --json $OUT/sweep-fwd-$cfg.json
    done
    for sg in on off; do
      WGPU_ATTENTION_SUBGROUPS=$sg step 40 sweep-subgroups-$sg $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 2048,4096 --masks none,causal --passes forward --paths fused --dtypes f32,f16 --reps 5 --validate-limit 0 --json $OUT/sweep-subgroups-$sg.json
    done
    for sp in 1 2 4 8 16; do
      WGPU_ATTENTION_SPLITS=$sp step 40 sweep-splits-$sp $B/attention-bench --kernels gpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 2048,8192 --masks none,causal --passes forward --paths fused --reps 5 --validate-limit 0 --json $OUT/sweep-splits-$sp.json
    done ;;
  trusted)
    # noloop: every kernel without loop counters, index clamps kept (tells the two checks apart).
    # (The additive bench at L 4096 outran 30 s per setting on the H200: L 1024 only.)
    for tr in on off noloop all; do
      WGPU_ATTENTION_TRUSTED_SHADERS=$tr step 40 sweep-trusted-$tr $B/attention-bench --kernels gpu,cpu --batch 1 --heads 8 --head-dim 64 \
        --lengths 1024,4096 --masks none,causal --passes forward,backward --paths fused --dtypes f32 --reps 5 --json $OUT/sweep-trusted-$tr.json
      WGPU_ATTENTION_TRUSTED_SHADERS=$tr step 20 sweep-trusted-gemm-$tr $B/gemm-bench --reps 5 --json $OUT/sweep-trusted-gemm-$tr.json
    done
    for tr in on all; do
      WGPU_ATTENTION_TRUSTED_SHADERS=$tr step 30 sweep-trusted-additive-$tr $B/additive-bench --lengths 1024 --reps 5 \
        --json $OUT/sweep-trusted-additive-$tr.json
    done ;;
  tune)
    # Issue 45: the autotuner against the static choice in one process (the fused-gpu rows are the
    # static GPU family, fused-tuned what tuning picks: family, tiles, split-KV), B1 H8 D64 then B4
    # H16 D128 sharing one cache file; the tuning report (every key's candidates, times, winner)
    # ends each log and is in each JSON. Then the tuner's tests on the device.
    step 170 tune-b1h8d64 $B/attention-bench --kernels gpu --tune --tuning-cache $OUT/tuning-cache.json \
      --dtypes f32,f16 --batch 1 --heads 8 --head-dim 64 --lengths 1024,4096,16384 --masks none,causal \
      --passes forward,backward --paths fused --reps 5 --json $OUT/tune-b1h8d64.json
    step 150 tune-b4h16d128 $B/attention-bench --kernels gpu --tune --tuning-cache $OUT/tuning-cache.json \
      --dtypes f32,f16 --batch 4 --heads 16 --head-dim 128 --lengths 1024,4096 --masks none,causal \
      --passes forward,backward --paths fused --reps 3 --json $OUT/tune-b4h16d128.json
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-tuning $B/test_tuning ;;
  tunetc)
    # Issue 45 with the tensor cores among the tuner's families (--tune-tensor-cores: the caller
    # accepts their tolerances): f16, where the tensor-core forward ran 2.2-3.2x the GPU family and
    # its backward 0.7-1.9x on an H200 (2026-11-28), so the tuner has a real choice per key.
    step 150 tunetc-b1h8d64 $B/attention-bench --kernels gpu --tune --tune-tensor-cores \
      --tuning-cache $OUT/tuning-cache-tc.json --dtypes f16 --batch 1 --heads 8 --head-dim 64 \
      --lengths 1024,4096,16384 --masks none,causal --passes forward,backward --paths fused --reps 5 \
      --json $OUT/tunetc-b1h8d64.json
    step 120 tunetc-b4h16d128 $B/attention-bench --kernels gpu --tune --tune-tensor-cores \
      --tuning-cache $OUT/tuning-cache-tc.json --dtypes f16 --batch 4 --heads 16 --head-dim 128 \
      --lengths 1024,4096 --masks none,causal --passes forward,backward --paths fused --reps 3 \
      --json $OUT/tunetc-b4h16d128.json ;;
  suite64)
    step 150 suite-b1h8d64 $B/attention-bench --kernels gpu --dtypes f32,f16 --batch 1 --heads 8 --head-dim 64 \
      --lengths 1024,2048,4096,8192,16384 --masks none,causal --passes forward,backward --paths fused,unfused \
      --reps 5 --json $OUT/h100-gpu-b1h8d64.json --plot $OUT/h100-gpu-b1h8d64.svg ;;
  suite128)
    step 200 suite-b4h16d128 $B/attention-bench --kernels gpu --dtypes f32,f16 --batch 4 --heads 16 --head-dim 128 \
      --lengths 1024,2048,4096,8192 --masks none,causal --passes forward,backward --paths fused,unfused \
      --reps 3 --json $OUT/h100-gpu-b4h16d128.json ;;
  cpu64)
    step 90 cpu-family-b1h8d64 $B/attention-bench --kernels cpu --batch 1 --heads 8 --head-dim 64 \
      --lengths 1024,2048,4096 --masks none,causal --passes forward,backward --paths fused \
      --reps 3 --json $OUT/h100-cpu-family-b1h8d64.json ;;
  gemm)
    step 60 gemm $B/gemm-bench --reps 10 --f16 --json $OUT/h100-gemm.json ;;
  gemmcoop)
    # Issue 47's tensor-core GEMM (64 x 64, 128 x 128, and coop's choice between them) against the
    # square kernel, f32 and f16 storage: the default layer shapes, a 4096-row model of width 1024,
    # and 4096 x 4096 x 4096 products (the square target) with width 4096 and d_ff 4096;
    # the larger ones unchecked against the CPU reference (its f64 loops take 15-20 s per product
    # there; the checked shapes and the test cover the kernels). Its qualification line says which
    # build ran. Then its test on the device (its cooperative build where it qualifies).
    step 60 gemmcoop-layers $B/gemm-bench --tiles 64x64,coop64,coop128,coop --f16 --reps 10 \
      --json $OUT/gemmcoop-layers.json
    step 90 gemmcoop-4096 $B/gemm-bench --tiles 64x64,coop64,coop128,coop --f16 --rows 4096 \
      --d-model 1024 --reps 5 --json $OUT/gemmcoop-4096.json
    step 90 gemmcoop-square $B/gemm-bench --tiles 64x64,coop64,coop128 --f16 --rows 4096 --d-model 4096 \
      --d-ff 4096 --reps 3 --json $OUT/gemmcoop-square.json
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-coop-gemm $B/test_linear tensor_core_gemm ;;
  mixed)
    # Issue 47 item 2: a training step in f32 and in mixed precision in one process, with the
    # step's GPU time by kernel family: the library's choice (f32 on the square GEMM, mixed on
    # tensor cores where they qualify), then both on the square GEMM (mixed precision's rounding
    # without tensor cores); the mixed-precision tests on the device (Linear products, loss
    # scaling, training and resume).
    # In priority order (a 280 s budget runs the first three or four): the step, the layer GEMMs
    # in f32 and mixed precision (square and tensor-core tiles, validated), the training tests.
    step 90 mixed-default $B/transformer-bench --precision f32,mixed --reps 10 --json $OUT/mixed-default.json
    step 60 mixed-gemm $B/gemm-bench --tiles 64x64,coop --mixed --reps 10 --json $OUT/mixed-gemm.json
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-mixed-training $B/test_training mixed
    WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-mixed-linear $B/test_linear mixed
    step 90 mixed-64x64 $B/transformer-bench --precision f32,mixed --reps 10 --gemm-tiles 64x64 \
      --json $OUT/mixed-64x64.json ;;
  transformer)
    for t in 64x64 128x64; do
      step 60 transformer-$t $B/transformer-bench --reps 10 --gemm-tiles $t --json $OUT/h100-transformer-$t.json
    done
    step 60 transformer-lm $B/transformer-bench --decoder-only --seq 256 --reps 10 --json $OUT/h100-transformer-lm.json
    # What the one-pass recording saves over a pass per kernel (step time and host recording time).
    WGPU_ATTENTION_PASS_PER_KERNEL=on step 60 transformer-pass-per-kernel $B/transformer-bench --reps 10 \
      --json $OUT/h100-transformer-pass-per-kernel.json ;;
  generate)
    step 120 generate $B/generate-bench --page 16 --json $OUT/h100-generate.json
    WGPU_ATTENTION_PASS_PER_KERNEL=on step 120 generate-pass-per-kernel $B/generate-bench --attention-lengths 0 \
      --json $OUT/h100-generate-pass-per-kernel.json ;;
  additive)
    # The fused additive kernels against the unfused path, then with the library's tuning, which
    # routes a key to the unfused path where it is faster (issue 45: the H100 of 2026-11-26 ran the
    # fused kernels at 0.17-0.26x the unfused speed, before their spills were removed).
    step 120 additive $B/additive-bench --json $OUT/h100-additive.json
    step 150 additive-tuned $B/additive-bench --tune --json $OUT/h100-additive-tuned.json ;;
  burn)
    # burn 0.22's attention (flash forward, unfused autodiff backward) against the fused op inside
    # burn, same run (burn picks the adapter); then the integration's tests on Vulkan.
    step 150 burn-bench $B/burn-bench --lengths 1024,2048,4096 --reps 5
    for t in against_burn; do
      WGPU_ATTENTION_TEST_BACKENDS=vulkan step 60 test-burn-$t $B/test_burn_$t
    done ;;
  tests)
    for t in attention_forward attention_backward attention_f16 linear transformer training optimizer generation; do
      WGPU_ATTENTION_TEST_BACKENDS=vulkan step 100 test-$t $B/test_$t
    done ;;
  esac
done
for f in $OUT/*.log; do echo "--- $f"; grep -E "^test result|FAILED|panicked|error|rc " $f | head -5; done
