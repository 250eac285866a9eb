//! Batched strided matrix product (`shaders/matmul_strided.wgsl`), used by the unfused attention
//! baseline. `C[z] = alpha * sum_g A[z, g] · B[z, g]` with every operand addressed by strides.

use crate::device::{grid_2d, Context};
use crate::error::{Error, Result};

pub(crate) const SOURCE: &str = include_str!("../../shaders/matmul_strided.wgsl");
const TILE: u32 = 64;

/// Element addressing of one operand: `offset + b*stride_b + (h/head_div)*stride_h + g*stride_g +
/// row*stride_row + col*stride_col`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Operand {
    pub offset: u32,
    pub stride_b: u32,
    pub stride_h: u32,
    pub head_div: u32,
    pub stride_g: u32,
    pub stride_row: u32,
    pub stride_col: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct GemmParams {
    m: u32,
    n: u32,
    k: u32,
    groups: u32,
    heads: u32,
    tiles_m: u32,
    tiles_n: u32,
    grid_x: u32,
    total_groups: u32,
    alpha: f32,
    _pad0: u32,
    _pad1: u32,
    a: Operand,
    b: Operand,
    c: Operand,
}

/// One batched product: `batch * heads` outputs of `m x n`, reduced over `groups * k`.
pub(crate) struct Gemm<'a> {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub groups: u32,
    pub batch: u32,
    pub heads: u32,
    pub alpha: f32,
    pub a: (&'a wgpu::Buffer, Operand),
    pub b: (&'a wgpu::Buffer, Operand),
    pub c: (&'a wgpu::Buffer, Operand),
}

/// Records one batched product into `pass`.
pub(crate) fn encode_gemm(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    g: &Gemm<'_>,
) -> Result<()> {
    let tiles_m = g.m.div_ceil(TILE);
    let tiles_n = g.n.div_ceil(TILE);
    let total = (tiles_m as u64) * (tiles_n as u64) * (g.batch as u64) * (g.heads as u64);
    let total = u32::try_from(total).map_err(|_| Error::Unsupported {
        arg: "matmul workgroups",
        value: total,
        limit: u32::MAX as u64,
        hint: "",
    })?;
    let (gx, gy) = grid_2d(total);
    let params = GemmParams {
        m: g.m,
        n: g.n,
        k: g.k,
        groups: g.groups,
        heads: g.heads,
        tiles_m,
        tiles_n,
        grid_x: gx,
        total_groups: total,
        alpha: g.alpha,
        a: g.a.1,
        b: g.b.1,
        c: g.c.1,
        ..Default::default()
    };
    let pipeline = ctx.pipeline("matmul_strided", || SOURCE.to_string(), &[]);
    let uniform = ctx.uniform("matmul params", &params);
    let bind_group = ctx.device().create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("matmul_strided"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: uniform.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: g.a.0.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: g.b.0.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 3,
                resource: g.c.0.as_entire_binding(),
            },
        ],
    });
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(gx, gy, 1);
    Ok(())
}
