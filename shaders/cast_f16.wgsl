// Elementwise out = f16(x): the f16 copy of f32 values (mixed precision's weight copies, refreshed
// from the f32 master weights before each step). Needs SHADER_F16.
enable f16;

struct Params {
    len: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f16>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.len {
        return;
    }
    out[i] = f16(x[i]);
}
