#!/bin/bash
# Decode attention's pipelines as generate-bench compiles them (f32 and int8 caches, contiguous and
# paged 16, batch 1 and 8, both kernel families), dumped for ../shared/tools/gpu-compile-report.
# Lavapipe's 32 KiB of workgroup storage picks 32-key tiles for the staged f32 kernel at D 64; a
# copy of each staged pipeline with the 64-key tile a 48 KiB GPU picks is added (`-WG64` files).
# Usage: dump-decode.sh GENERATE_BENCH OUT
BIN=$1; OUT=$2; rm -rf "$OUT"; mkdir -p "$OUT"
export WGPU_ATTENTION_DUMP_PIPELINES=$OUT WGPU_BACKEND=vulkan
# The CPU drivers' family (lavapipe's default: caches read in place) and the GPU family (f32 staged).
for family in cpu gpu; do
  WGPU_ATTENTION_KERNELS=$family "$BIN" --compile-only --page 16 --int8 > /dev/null 2>>"$OUT.log" || echo "FAIL generate $family"
  WGPU_ATTENTION_KERNELS=$family "$BIN" --compile-only --heads 32 > /dev/null 2>>"$OUT.log" || echo "FAIL generate H32 $family"
done
find "$OUT" -name '*.json' ! -name 'attention_decode*' -delete
find "$OUT" -name '*.wgsl' ! -name 'attention_decode*' -delete
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for meta in sorted(out.glob('attention_decode*.json')):
    spec = json.loads(meta.read_text())
    constants = dict(spec['constants'])
    if constants.get('WG') == 32 and 'STAGED' not in constants:
        constants['WG'] = 64
        spec['constants'] = constants
        name = meta.stem + '-WG64'
        spec['label'] = name
        (out / (name + '.json')).write_text(json.dumps(spec))
        (out / (name + '.wgsl')).write_text((out / (meta.stem + '.wgsl')).read_text())
PY
ls "$OUT"/*.wgsl | wc -l
