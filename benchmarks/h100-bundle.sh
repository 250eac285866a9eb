#!/bin/bash
# Prepares what benchmarks/h100-run.sh needs on the device machine, here (see ../shared/GPU.md): the
# Vulkan loader packages in .gl/ and the stripped release binaries (benches and the attention, linear,
# transformer and training tests) in .gpu/bundle.tar.xz, both git-ignored. Then, with the device tool,
# the call benchmarks/README.md lists (vulkaninfo needs libwayland-client0, absent on the H200 image), e.g.:
#   run(command="PLAN='sweep suite64 gemm transformer' bash benchmarks/h100-run.sh",
#       carry=[".gl", ".gpu/bundle.tar.xz"])
set -eu
cd "$(dirname "$0")/.."
mkdir -p .git/info .gl .gpu/bin /tmp/amd64/partial
for ignored in /.gl/ /.gpu/; do
  grep -qx "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
if ! ls .gl/libwayland-client0_*.deb > /dev/null 2>&1; then
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  apt-get $o update > /dev/null
  (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 vulkan-tools libwayland-client0)
fi
cargo build --release -p wgpu-attention-bench --bins
# The integration tests are one binary per crate (tests/engine, crates/transformer/tests/model,
# crates/serve/tests/serving); test_MODULE (written below) runs one module's tests.
tests="engine:attention_forward engine:attention_backward engine:attention_f16 engine:attention_decode engine:tuning engine:linear engine:optimizer engine:additive engine:nan model:transformer model:transformer_layer model:training model:attention_maps serving:generation serving:paged_cache"
built=$(cargo test --release -p wgpu-attention -p wgpu-attention-transformer -p wgpu-attention-serve --no-run 2>&1 | sed -n 's/.*Executable tests\/\([a-z]*\)\/main.rs (\(.*\))/\1 \2/p')
rm -rf .gpu/bin && mkdir -p .gpu/bin
for b in attention-bench gemm-bench transformer-bench additive-bench generate-bench; do
  cp target/release/$b .gpu/bin/
done
for suite in engine model serving; do
  cp "$(echo "$built" | awk -v s=$suite '$1 == s { print $2 }')" .gpu/bin/suite_$suite
done
# The server example (continuous batching over a paged cache; issue 46's tokens/s by batch).
cargo build --release -p wgpu-attention-serve --example serve
cp target/release/examples/serve .gpu/bin/serve
# The burn integration: its bench (burn's attention against the fused op inside burn) and its tests.
cargo build --release -p burn-attention --example bench
cp target/release/examples/bench .gpu/bin/burn-bench
burn_built=$(cargo test --release -p burn-attention --no-run 2>&1 | sed -n 's/.*Executable tests\/.*(\(.*\))/\1/p')
for t in against_burn; do
  cp "$(echo "$burn_built" | grep "/$t-")" .gpu/bin/test_burn_$t
done
# With BASE=<commit>: generate-bench built at that commit too, as generate-bench-base, which the
# decodeattn and decodesteps steps run beside the current one (before/after in one call).
if [ -n "${BASE:-}" ]; then
  base=$(mktemp -d)
  git worktree add --detach "$base" "$BASE" > /dev/null
  (cd "$base" && CARGO_TARGET_DIR="$PWD/../base-target" cargo build --release -p wgpu-attention-bench --bin generate-bench)
  cp "$base/../base-target/release/generate-bench" .gpu/bin/generate-bench-base
  git worktree remove --force "$base"
fi
strip .gpu/bin/*
# test_MODULE: the module's tests of its suite binary, $1 a filter within them (a substring of the
# test's name, as the binaries per test file took it); the tests are listed, then run by exact name.
for entry in $tests; do
  suite=${entry%%:*}; module=${entry#*:}
  cat > .gpu/bin/test_$module <<WRAPPER
#!/bin/sh
d=\$(dirname "\$0")
names=\$("\$d/suite_$suite" --list 2>/dev/null | sed -n 's/^\($module::.*\): test\$/\1/p' | grep -F -- "\${1:-}")
[ -n "\$names" ] || { echo "no $module test matches '\${1:-}'"; exit 1; }
exec "\$d/suite_$suite" --exact \$names
WRAPPER
  chmod +x .gpu/bin/test_$module
done
tar -C .gpu -cJf .gpu/bundle.tar.xz bin
ls -la .gpu/bundle.tar.xz
