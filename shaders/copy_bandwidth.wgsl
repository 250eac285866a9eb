// The adapter's memory-bandwidth reference, measured: a plain copy of vec4 words, 16 bytes a
// load and a store, coalesced (consecutive invocations read consecutive words). Each invocation
// issues four loads before its stores, grid-stride over the binding, so a few thousand
// workgroups keep every memory channel busy. Decode attention's bandwidth is reported as a share
// of what this copy reaches in the same run (a buffer-to-buffer copy may take a DMA engine that
// tops out far below the memory's bandwidth).

override WG: u32 = 256u;

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = arrayLength(&dst);
    let stride = groups.x * groups.y * WG;
    let first = (wg.y * groups.x + wg.x) * WG + lid;
    for (var i = first; i < n; i += 4u * stride) {
        // Written out: every load of the round is issued before the first store waits on one.
        let w0 = src[min(i, n - 1u)];
        let w1 = src[min(i + stride, n - 1u)];
        let w2 = src[min(i + 2u * stride, n - 1u)];
        let w3 = src[min(i + 3u * stride, n - 1u)];
        dst[i] = w0;
        if i + stride < n {
            dst[i + stride] = w1;
        }
        if i + 2u * stride < n {
            dst[i + 2u * stride] = w2;
        }
        if i + 3u * stride < n {
            dst[i + 3u * stride] = w3;
        }
    }
}
