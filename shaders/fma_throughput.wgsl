// The adapter's ALU limit, measured: every invocation runs ITERATIONS rounds of 8 independent vec4
// FMA chains (64 FLOP per round) on register data only, then stores one value so nothing is
// eliminated. The host checks that value against the same recurrence on the CPU.
//
// Loop iterations per invocation stay far below llvmpipe's 65535 cap (see KERNELS.md).

override WG: u32 = 64u;
override ITERATIONS: u32 = 512u;

@group(0) @binding(0) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let index = gid.y * groups.x * WG + gid.x;
    let seed = f32(index % 64u) * (1.0 / 64.0);
    // |a| < 1 keeps every chain bounded: x -> x * a + b converges to b / (1 - a).
    let a = vec4<f32>(0.5, 0.25, -0.5, 0.125);
    let b = vec4<f32>(seed, 0.5, 0.25, -0.125);
    var x0 = vec4<f32>(seed);
    var x1 = x0 + 0.125;
    var x2 = x0 + 0.25;
    var x3 = x0 + 0.375;
    var x4 = x0 - 0.125;
    var x5 = x0 - 0.25;
    var x6 = x0 - 0.375;
    var x7 = x0 + 0.5;
    for (var i = 0u; i < ITERATIONS; i++) {
        x0 = fma(x0, a, b);
        x1 = fma(x1, a, b);
        x2 = fma(x2, a, b);
        x3 = fma(x3, a, b);
        x4 = fma(x4, a, b);
        x5 = fma(x5, a, b);
        x6 = fma(x6, a, b);
        x7 = fma(x7, a, b);
    }
    let s = (x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7);
    out[index] = s.x + s.y + s.z + s.w;
}
