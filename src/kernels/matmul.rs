//! Batched strided matrix product (`shaders/matmul_strided.wgsl`), used by the unfused attention
//! baseline and the Linear layer (bias, activation and residual epilogues).
//! `C[z] = alpha * sum_g A[z, g] · B[z, g]` with every operand addressed by strides.

use crate::device::{Context, GemmTiles, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::attention::matrix_build;
use crate::kernels::elementwise::Activation;
use crate::kernels::matrix::{mismatch, record_qualification, tile_element, MatrixBuild};
use crate::tensor::{DType, GpuTensor, Region};

/// The GEMM shader bodies, each after the activation functions its epilogues share with the
/// elementwise kernels and the GEMMs' common header: 64 x 64 tiles (and SKINNY), and 128 x 64 tiles.
/// [`typed_source`] prepends the element types.
const SOURCE: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/matmul_common.wgsl"),
    include_str!("../../shaders/matmul_strided.wgsl")
);
const WIDE_SOURCE: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/matmul_common.wgsl"),
    include_str!("../../shaders/matmul_wide.wgsl")
);
/// The tensor-core kernel: the matrix interface's build is appended ([`coop_source`]).
const COOP_SOURCE: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/matmul_common.wgsl"),
    include_str!("../../shaders/matmul_coop.wgsl")
);

/// Element types of a GEMM: A, B and C as stored, and whether the products round A and B to f16
/// (mixed precision: f32 storage, the operands tensor cores would take). f16 storage needs
/// `SHADER_F16`, as does the rounding; the arithmetic is f32 either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Elements {
    a: DType,
    b: DType,
    output: DType,
    rounded: bool,
}

impl Elements {
    pub const F32: Elements = Elements {
        a: DType::F32,
        b: DType::F32,
        output: DType::F32,
        rounded: false,
    };
    pub const F16: Elements = Elements {
        a: DType::F16,
        b: DType::F16,
        output: DType::F16,
        rounded: false,
    };
    /// Mixed precision on f32 operands: both rounded to f16 as read, f32 result (a Linear
    /// layer's weight gradient `dy^T x`).
    pub const MIXED: Elements = Elements {
        rounded: true,
        ..Self::F32
    };
    /// Mixed precision with an f16 B (a Linear layer's f16 weight copy): A rounded to f16 as
    /// read, f32 result (`x W^T`, `dy W`).
    pub const MIXED_F16_B: Elements = Elements {
        b: DType::F16,
        ..Self::MIXED
    };
    const ALL: [Elements; 4] = [Self::F32, Self::F16, Self::MIXED, Self::MIXED_F16_B];

    /// The pipeline name's index in [`Kernel::names`]; the fields are private, so the constants
    /// above are every value.
    fn index(self) -> usize {
        match (self.a, self.b, self.rounded) {
            (DType::F32, DType::F32, false) => 0,
            (DType::F16, _, _) => 1,
            (DType::F32, DType::F32, true) => 2,
            (DType::F32, DType::F16, _) => 3,
        }
    }

    /// Mixed precision's products ([`Elements::MIXED`], [`Elements::MIXED_F16_B`]).
    fn is_mixed(self) -> bool {
        self.rounded
    }

    fn uses_f16(self) -> bool {
        self.rounded || [self.a, self.b, self.output].contains(&DType::F16)
    }

    /// The WGSL that declares these types before a GEMM body: `GemmA`, `GemmB`, `GemmOut` and
    /// `operand` (the rounding of A's and B's elements, `matmul_common.wgsl`).
    fn header(self) -> String {
        let operand = match self.rounded {
            true => "f32(f16(x))",
            false => "x",
        };
        format!(
            "alias GemmA = {};\nalias GemmB = {};\nalias GemmOut = {};\n\
             fn operand(x: f32) -> f32 {{\n    return {operand};\n}}\n",
            self.a.name(),
            self.b.name(),
            self.output.name()
        )
    }
}

/// A GEMM body with its element types declared before it ([`Elements::header`]).
fn typed_source(body: &str, elements: Elements) -> String {
    let enable = match elements.uses_f16() {
        true => "enable f16;\n",
        false => "",
    };
    format!("{enable}{}{body}", elements.header())
}

/// The tensor-core GEMM's tile groups and accumulator tiles per group (`matmul_coop.wgsl`'s
/// GROUPS_M, GROUPS_N, TM, TN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CoopTiles {
    groups_m: u32,
    groups_n: u32,
    tm: u32,
    tn: u32,
}

impl CoopTiles {
    /// 64 x 64: 2 x 2 groups of 2 x 2 tiles.
    const SQUARE: CoopTiles = CoopTiles {
        groups_m: 2,
        groups_n: 2,
        tm: 2,
        tn: 2,
    };
    /// 128 x 128: 2 x 4 groups of 4 x 2 tiles (a group's A tiles serve two products each, its B
    /// tiles four).
    const WIDE: CoopTiles = CoopTiles {
        groups_m: 2,
        groups_n: 4,
        tm: 4,
        tn: 2,
    };

    fn groups(self) -> u32 {
        self.groups_m * self.groups_n
    }

    const fn tile_m(self) -> u32 {
        16 * self.groups_m * self.tm
    }

    const fn tile_n(self) -> u32 {
        16 * self.groups_n * self.tn
    }

    /// Whether a workgroup of these tiles with `group`-wide tile groups fits `ctx`'s limits: its
    /// invocations (at least one per row of A's tile, which the row sums take), the staged A
    /// [TILE_M x 40] and B [32 x TILE_N + 8] in `tile_element`s and each group's f32 slice
    /// [16 x 20] (`matmul_coop.wgsl`).
    fn fit(self, ctx: &Context, group: u32) -> bool {
        let limits = ctx.limits();
        let invocations = self.groups() * group;
        let staged = (self.tile_m() * 40 + 32 * (self.tile_n() + 8)) as u64;
        let bytes = staged * tile_element(ctx).size() + (self.groups() * 16 * 20 * 4) as u64;
        invocations >= self.tile_m()
            && invocations <= limits.max_compute_invocations_per_workgroup
            && invocations <= limits.max_compute_workgroup_size_x
            && bytes <= u64::from(limits.max_compute_workgroup_storage_size)
    }
}

/// The tensor-core kernel a product runs: its matrix build, tile group ([`coop_build`]) and tiles
/// ([`coop_tiles`]).
type CoopChoice = (MatrixBuild, u32, CoopTiles);

/// Workgroups a product needs before [`GemmTiles::Coop`] gives it 128 x 128 tiles: about two per
/// SM on a 132-SM H100 or H200, where 64 x 64 tiles would give four times as many (unmeasured: the
/// model's 1024-row products keep 64 x 64, the 4096-row ones take 128 x 128).
const COOP_WIDE_WORKGROUPS: u64 = 256;

/// The tensor-core GEMM for `elements` with the matrix interface's `build` on `tiles` (MatElem),
/// its tile `shape` with `group`-wide tile groups (the staging counts per invocation, and the
/// portable build's accumulator slots per invocation).
fn coop_source(
    elements: Elements,
    build: MatrixBuild,
    tiles: DType,
    group: u32,
    shape: CoopTiles,
) -> String {
    let f16 = elements.uses_f16() || tiles == DType::F16;
    let mut text = String::from(if f16 { "enable f16;\n" } else { "" });
    text.push_str(build.enable());
    text.push_str(&elements.header());
    text.push_str(&format!("alias MatElem = {};\n", tiles.name()));
    if build == MatrixBuild::Portable {
        text.push_str(&format!(
            "const MAT_SLOTS: u32 = {}u;\n",
            256 / group.min(256)
        ));
    }
    let invocations = shape.groups() * group;
    text.push_str(&format!(
        "const GROUPS_M: u32 = {}u;\nconst GROUPS_N: u32 = {}u;\nconst TM: u32 = {}u;\n\
         const TN: u32 = {}u;\nconst LOADS_A: u32 = {}u;\nconst LOADS_B: u32 = {}u;\n",
        shape.groups_m,
        shape.groups_n,
        shape.tm,
        shape.tn,
        (shape.tile_m() * 32).div_ceil(invocations),
        (shape.tile_n() * 32).div_ceil(invocations),
    ));
    text.push_str(COOP_SOURCE);
    text.push('\n');
    text.push_str(build.interface());
    text
}

/// The tensor-core GEMM's pipeline name: the tiles (`matmul_coop` 64 x 64, `matmul_coop128`), the
/// build, then f16 storage (`_f16`), an f16 B with f32 A and C (`_f16b`, mixed precision) or, for
/// f32 storage, f16 tiles in the portable build (`_f16tiles`; the cooperative build's tiles are
/// always f16). The tiles round A and B to their type, so mixed precision's rounding
/// ([`Elements::rounded`]) is theirs: [`coop_elements`] drops it.
fn coop_name(
    build: MatrixBuild,
    elements: Elements,
    tiles: DType,
    shape: CoopTiles,
) -> &'static str {
    use DType::{F16, F32};
    use MatrixBuild::{Cooperative, Portable};
    let wide = shape == CoopTiles::WIDE;
    match (wide, build, elements.a, elements.b, tiles) {
        (false, Cooperative, F16, _, _) => "matmul_coop_f16",
        (false, Cooperative, F32, F16, _) => "matmul_coop_f16b",
        (false, Cooperative, F32, F32, _) => "matmul_coop",
        (false, Portable, F16, _, _) => "matmul_coop_portable_f16",
        (false, Portable, F32, F16, _) => "matmul_coop_portable_f16b",
        (false, Portable, F32, F32, F16) => "matmul_coop_portable_f16tiles",
        (false, Portable, F32, F32, F32) => "matmul_coop_portable",
        (true, Cooperative, F16, _, _) => "matmul_coop128_f16",
        (true, Cooperative, F32, F16, _) => "matmul_coop128_f16b",
        (true, Cooperative, F32, F32, _) => "matmul_coop128",
        (true, Portable, F16, _, _) => "matmul_coop128_portable_f16",
        (true, Portable, F32, F16, _) => "matmul_coop128_portable_f16b",
        (true, Portable, F32, F32, F16) => "matmul_coop128_portable_f16tiles",
        (true, Portable, F32, F32, F32) => "matmul_coop128_portable",
    }
}

/// `elements` as the tensor-core GEMM builds them on f16 `tiles`: without the rounding, which the
/// tiles apply (the same values reach the products).
fn coop_elements(elements: Elements, tiles: DType) -> Elements {
    match tiles {
        DType::F16 => Elements {
            rounded: false,
            ..elements
        },
        DType::F32 => elements,
    }
}

/// Every GEMM variant by pipeline name, for the shader translation test: the tensor-core one in
/// both builds, its tiles as each device type gets them, tile groups of 32.
pub(crate) fn shader_sources() -> Vec<(&'static str, String)> {
    let mut sources: Vec<_> = [SQUARE, WIDE]
        .iter()
        .flat_map(|kernel| {
            Elements::ALL
                .iter()
                .map(|&e| (kernel.names[e.index()], typed_source(kernel.source, e)))
        })
        .collect();
    for (build, elements, tiles) in [
        (MatrixBuild::Cooperative, Elements::F32, DType::F16),
        (MatrixBuild::Cooperative, Elements::F16, DType::F16),
        (MatrixBuild::Portable, Elements::F32, DType::F32),
        (MatrixBuild::Portable, Elements::F32, DType::F16),
        (MatrixBuild::Portable, Elements::F16, DType::F16),
        (
            MatrixBuild::Cooperative,
            coop_elements(Elements::MIXED_F16_B, DType::F16),
            DType::F16,
        ),
        (
            MatrixBuild::Portable,
            coop_elements(Elements::MIXED_F16_B, DType::F16),
            DType::F16,
        ),
    ] {
        for shape in [CoopTiles::SQUARE, CoopTiles::WIDE] {
            let name = coop_name(build, elements, tiles, shape);
            sources.push((name, coop_source(elements, build, tiles, 32, shape)));
        }
    }
    sources
}

/// Output tile, shader and loop iterations one invocation runs per 16-deep k tile (the k-tile loop,
/// the tile loads and the 16 k steps) of one GEMM kernel.
#[derive(Clone, Copy)]
struct Kernel {
    /// Pipeline names by [`Elements`] (f32, f16, mixed, mixed with an f16 B).
    names: [&'static str; 4],
    /// The names of the CPU-driver family's SKINNY build (an element per invocation).
    cpu_names: [&'static str; 4],
    source: &'static str,
    tile_m: u32,
    tile_n: u32,
    loop_cost_per_k_tile: u64,
    /// Has the `SKINNY` override (products of a few rows: an element per invocation, or k split
    /// over lanes).
    skinny: bool,
}

const SQUARE: Kernel = Kernel {
    names: [
        "matmul_strided",
        "matmul_strided_f16",
        "matmul_strided_mixed",
        "matmul_strided_mixed_f16b",
    ],
    cpu_names: [
        "matmul_strided_cpu",
        "matmul_strided_f16_cpu",
        "matmul_strided_mixed_cpu",
        "matmul_strided_mixed_f16b_cpu",
    ],
    source: SOURCE,
    tile_m: 64,
    tile_n: 64,
    loop_cost_per_k_tile: 1 + 4 + 16,
    skinny: true,
};

const WIDE: Kernel = Kernel {
    names: [
        "matmul_wide",
        "matmul_wide_f16",
        "matmul_wide_mixed",
        "matmul_wide_mixed_f16b",
    ],
    cpu_names: [
        "matmul_wide",
        "matmul_wide_f16",
        "matmul_wide_mixed",
        "matmul_wide_mixed_f16b",
    ],
    source: WIDE_SOURCE,
    tile_m: 128,
    tile_n: 64,
    loop_cost_per_k_tile: 1 + 8 + 4 + 16,
    skinny: false,
};

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

impl Operand {
    /// A row-major matrix of `cols` columns (one batch entry, head and group).
    pub(crate) fn row_major(cols: usize) -> Operand {
        Operand {
            head_div: 1,
            stride_row: cols as u32,
            stride_col: 1,
            ..Default::default()
        }
    }

    /// The transpose of a row-major matrix of `cols` columns (a Linear layer's `W^T`).
    pub(crate) fn transposed(cols: usize) -> Operand {
        Operand {
            head_div: 1,
            stride_row: 1,
            stride_col: cols as u32,
            ..Default::default()
        }
    }
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
    has_bias: u32,
    accumulate: u32,
    activation: u32,
    activation_grad: u32,
    has_residual: u32,
    _pad: u32,
    a: Operand,
    b: Operand,
    c: Operand,
}

/// One batched product: `batch * heads` outputs of `m x n`, reduced over `groups * k`.
#[derive(Clone, Copy)]
pub(crate) struct Gemm<'a> {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub groups: u32,
    pub batch: u32,
    pub heads: u32,
    pub alpha: f32,
    pub a: (Region<'a>, Operand),
    pub b: (Region<'a>, Operand),
    pub c: (Region<'a>, Operand),
    pub epilogue: Epilogue<'a>,
    /// Also `row_sums[m] = sum over g and k of A[0, g, m, k]` (`ROW_SUMS` in the shaders): the bias
    /// gradient inside the dW product. Not on the SKINNY path ([`takes_skinny_path`]).
    pub row_sums: Option<Region<'a>>,
    pub elements: Elements,
}

/// What the GEMM applies to each element `z` of `alpha * A·B` before storing it, in this order
/// (`shaders/matmul_strided.wgsl`): `pre` and `residual` are laid out as C.
#[derive(Clone, Copy, Default)]
pub(crate) struct Epilogue<'a> {
    /// `z += bias[col]` (`[n]`).
    pub bias: Option<Region<'a>>,
    /// [`ActivationStep::Forward`]: `pre = z; z = act(z)`. [`ActivationStep::Grad`]:
    /// `z *= act'(pre)`.
    pub activation: Option<(Activation, ActivationStep, Region<'a>)>,
    /// `z += residual`.
    pub residual: Option<Region<'a>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActivationStep {
    Forward,
    Grad,
}

impl Epilogue<'_> {
    pub const NONE: Epilogue<'static> = Epilogue {
        bias: None,
        activation: None,
        residual: None,
    };
}

/// The tensor-core GEMM's tile group in the portable build: 32, NVIDIA's subgroup, so the tests run
/// the shape the tensor cores do.
const COOP_PORTABLE_GROUP: u32 = 32;

/// Products with at most this many rows take the SKINNY path (all rows per workgroup, k split):
/// a decoding step's rows, for which a 64-row tile would be almost all padding (benchmarks/HISTORY.md,
/// "Figures that code comments carried").
const SKINNY_ROWS: u32 = 8;

/// The SKINNY path's form on `ctx`: `None` one invocation per element (the CPU-driver family),
/// else k split over lanes (`SKINNY_SPLIT`) with the lanes per column of C and whether they run
/// along k (`K_LANES`, `K_FAST`): 32 along k where B is contiguous in k (a Linear layer's W^T: a
/// warp reads 128 contiguous bytes of a weight row), else 8 lanes across 32 neighbouring columns.
fn skinny_split(ctx: &Context, g: &Gemm<'_>) -> Option<(u32, bool)> {
    if ctx.kernel_family() == KernelFamily::CpuDriver {
        return None;
    }
    Some(match g.b.1.stride_row == 1 && g.b.1.stride_col != 1 {
        true => (32, true),
        false => (8, false),
    })
}

/// Whether `g` runs on the SKINNY path (products of at most [`SKINNY_ROWS`] rows), which has no
/// row sums.
pub(crate) fn takes_skinny_path(ctx: &Context, g: &Gemm<'_>) -> bool {
    g.m <= SKINNY_ROWS
        && ctx
            .loop_budget()
            .is_none_or(|budget| g.groups as u64 * g.k as u64 <= budget as u64)
}

/// The tensor-core kernel (`shaders/matmul_coop.wgsl`) in `shape`; its loop cost is the portable
/// build's (the only one a loop budget applies to), per 16 of k: half a 32-deep tile's staging
/// (16 elements per invocation in both shapes), products (TM x TN multiply-adds of 8 slots x 18
/// iterations per group and 16 of k) and row sums.
const fn coop_kernel(shape: CoopTiles) -> Kernel {
    Kernel {
        // Named by `coop_name` (tiles, build and element types) when recorded.
        names: ["matmul_coop"; 4],
        cpu_names: ["matmul_coop"; 4],
        source: COOP_SOURCE,
        tile_m: shape.tile_m(),
        tile_n: shape.tile_n(),
        loop_cost_per_k_tile: 16 + (shape.tm * shape.tn) as u64 * 8 * 18 + 16,
        skinny: false,
    }
}

/// The tensor-core kernel's matrix build and tile group on `ctx`: the build the attention's
/// tensor-core family qualified on the device (the same interface functions), the subgroup as the
/// tile group (32 in the portable build); `None` where a 64 x 64 workgroup exceeds the device's
/// limits (the square kernel runs instead).
fn coop_build(ctx: &Context) -> Result<Option<(MatrixBuild, u32)>> {
    let mut build = matrix_build(ctx)?;
    if build == MatrixBuild::Cooperative && !gemm_qualified(ctx) {
        build = MatrixBuild::Portable;
    }
    let group = coop_group(ctx, build);
    Ok(CoopTiles::SQUARE.fit(ctx, group).then_some((build, group)))
}

/// The tile group of the tensor-core GEMM in `build` on `ctx`: the subgroup (32 in the portable
/// build, NVIDIA's, so the tests run the shape the tensor cores do).
fn coop_group(ctx: &Context, build: MatrixBuild) -> u32 {
    match build {
        MatrixBuild::Cooperative => ctx.subgroup_size().unwrap_or(COOP_PORTABLE_GROUP),
        MatrixBuild::Portable => COOP_PORTABLE_GROUP,
    }
}

/// Whether the tensor-core GEMM's cooperative build qualified on `ctx` ([`qualify_gemm_build`],
/// run once per context): where it did not, its portable build runs.
fn gemm_qualified(ctx: &Context) -> bool {
    const KEY: &str = "matmul_coop";
    if let Some(passed) = ctx.qualification(KEY) {
        return passed;
    }
    let why_not = mismatch(qualify_gemm_build(ctx, MatrixBuild::Cooperative));
    record_qualification(
        ctx,
        KEY,
        why_not,
        "the tensor-core GEMM runs its portable build",
        "the tensor-core GEMM runs on cooperative matrices",
    )
}

/// The qualification the tensor-core GEMM runs on a device before it uses its cooperative build
/// (after the attention's, whose matrix interface it shares): an 80 x 96 product over k = 72
/// (partial tiles in every dimension, three k tiles) with its 64 x 64 and 128 x 128 tiles in
/// `build`, against the square kernel on the same device. `None` if every element agrees within
/// f16 accuracy (2^-8 of one plus its size, as `reference::compare::TENSOR_CORE_*`), else what
/// differed. (The tests run it with the portable build.)
pub fn qualify_gemm_build(ctx: &Context, build: MatrixBuild) -> Result<Option<String>> {
    let (m, n, k) = (80, 96, 72);
    // Values in [-1, 1), B's scaled by 1 / sqrt(k) so that the products are about one.
    let values = |count: usize, seed: usize, scale: f32| -> Vec<f32> {
        (0..count)
            .map(|i| (((i * 7919 + seed * 104_729) % 2000) as f32 / 1000.0 - 1.0) * scale)
            .collect()
    };
    let a = GpuTensor::from_slice(ctx, &values(m * k, 1, 1.0), &[m, k])?;
    let b = GpuTensor::from_slice(ctx, &values(n * k, 2, 1.0 / (k as f32).sqrt()), &[n, k])?;
    let group = coop_group(ctx, build);
    let shapes: Vec<CoopTiles> = [CoopTiles::SQUARE, CoopTiles::WIDE]
        .into_iter()
        .filter(|shape| shape.fit(ctx, group))
        .collect();
    if shapes.is_empty() {
        return Ok(Some(
            "its tiles do not fit the workgroup limits".to_string(),
        ));
    }
    let outputs = (0..=shapes.len())
        .map(|_| GpuTensor::zeros(ctx, &[m, n]))
        .collect::<Result<Vec<_>>>()?;
    let (ra, rb) = (a.region(), b.region());
    let gemm = |c| product_of_rows(ra, rb, c, [m, n, k]);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "matmul_qualification");
        let square = gemm(outputs[0].region());
        let grid = gemm_grid(ctx, &square, SQUARE, false)?;
        encode_one(ctx, &mut pass, &square, (SQUARE, None), grid, false, false)?;
        for (shape, c) in shapes.iter().zip(&outputs[1..]) {
            let (kernel, product) = (coop_kernel(*shape), gemm(c.region()));
            let grid = gemm_grid(ctx, &product, kernel, false)?;
            let coop = Some((build, group, *shape));
            encode_one(ctx, &mut pass, &product, (kernel, coop), grid, false, false)?;
        }
    }
    ctx.submit(encoder)?;
    let reference = outputs[0].to_vec(ctx)?;
    for (shape, c) in shapes.iter().zip(&outputs[1..]) {
        let got = c.to_vec(ctx)?;
        let (index, worst) = got
            .iter()
            .zip(&reference)
            .map(|(x, y)| match x.is_finite() {
                true => (x - y).abs() / (1.0 + y.abs()),
                false => f32::INFINITY,
            })
            .enumerate()
            .fold((0, 0.0f32), |w, (i, e)| if e > w.1 { (i, e) } else { w });
        if worst > 1.0 / 256.0 {
            return Ok(Some(format!(
                "its {} x {} tiles differ from the square kernel by {worst:.3e} of (1 + |c|) at \
                 element {index}",
                shape.tile_m(),
                shape.tile_n()
            )));
        }
    }
    Ok(None)
}

/// `C [m x n] = A [m x k] . B^T` for row-major A, B [n x k] and C, f32, no epilogue: a Linear
/// layer's `x W^T` (and the GEMM qualification's product).
pub(crate) fn product_of_rows<'a>(
    a: Region<'a>,
    b: Region<'a>,
    c: Region<'a>,
    [m, n, k]: [usize; 3],
) -> Gemm<'a> {
    Gemm {
        m: m as u32,
        n: n as u32,
        k: k as u32,
        groups: 1,
        batch: 1,
        heads: 1,
        alpha: 1.0,
        a: (a, Operand::row_major(k)),
        b: (b, Operand::transposed(k)),
        c: (c, Operand::row_major(n)),
        epilogue: Epilogue::NONE,
        row_sums: None,
        elements: Elements::F32,
    }
}

/// The tensor-core tiles `tiles` give `g` on `ctx` where they fit (`group`-wide tile groups):
/// 128 x 128 for [`GemmTiles::Coop128`], and for [`GemmTiles::Coop`] where that grid has
/// [`COOP_WIDE_WORKGROUPS`]; else 64 x 64.
fn coop_tiles(ctx: &Context, tiles: GemmTiles, g: &Gemm<'_>, group: u32) -> CoopTiles {
    let wide = CoopTiles::WIDE;
    let grid = |t: CoopTiles| {
        u64::from(g.m.div_ceil(t.tile_m()))
            * u64::from(g.n.div_ceil(t.tile_n()))
            * u64::from(g.batch)
            * u64::from(g.heads)
    };
    let wanted = match tiles {
        GemmTiles::Coop128 => true,
        GemmTiles::Coop => grid(wide) >= COOP_WIDE_WORKGROUPS,
        _ => false,
    };
    match wanted && wide.fit(ctx, group) {
        true => wide,
        false => CoopTiles::SQUARE,
    }
}

/// The tiles `g` runs on, with the tensor-core kernel's build, tile group and tiles where they are
/// those: the context's tiles ([`Context::gemm_tiles`]), except that a mixed-precision product on
/// a context whose tiles the application did not choose takes the tensor cores
/// ([`GemmTiles::Coop`]) where the tensor-core GEMM runs on cooperative matrices (qualified on the
/// device): they compute what mixed precision asks for, f16 operands with f32 accumulation, so the
/// choice changes no bound, only the speed. Elsewhere (a portable build would be slow) the
/// adapter's tiles round the operands themselves.
fn tiles_for(ctx: &Context, g: &Gemm<'_>) -> Result<(GemmTiles, Option<CoopChoice>)> {
    let tiles = ctx.gemm_tiles();
    let mixed_default = g.elements.is_mixed()
        && !ctx.gemm_tiles_chosen()
        && ctx.kernel_family() != KernelFamily::CpuDriver;
    if !tiles.is_coop() && !mixed_default {
        return Ok((tiles, None));
    }
    // Tiles the application asked for take the tensor-core kernel in either build; mixed
    // precision by default only on cooperative matrices.
    let (tiles, (build, group)) = match coop_build(ctx)? {
        Some(coop) if tiles.is_coop() => (tiles, coop),
        Some(coop @ (MatrixBuild::Cooperative, _)) => (GemmTiles::Coop, coop),
        _ => return Ok((tiles, None)),
    };
    Ok((
        tiles,
        Some((build, group, coop_tiles(ctx, tiles, g, group))),
    ))
}

/// The kernel a product runs: its tiles, the tensor-core build where it takes one, and whether it
/// takes the SKINNY path (a decoding step's few rows).
fn gemm_plan(ctx: &Context, g: &Gemm<'_>) -> Result<(Kernel, Option<CoopChoice>, bool)> {
    // 128-row tiles only where they fill: shorter products keep the 64 x 64 kernel. Tensor-core
    // tiles where asked for, a decoding step's few rows excepted (the SKINNY path).
    let (tiles, coop) = tiles_for(ctx, g)?;
    let kernel = match (tiles, coop) {
        (_, Some((_, _, shape))) => coop_kernel(shape),
        (GemmTiles::Wide128x64, _) if g.m >= WIDE.tile_m => WIDE,
        _ => SQUARE,
    };
    match takes_skinny_path(ctx, g) {
        true => Ok((SQUARE, None, true)),
        false => Ok((kernel, coop, false)),
    }
}

/// A product's workgroups, the same for every dispatch of it (its k chunks differ in k and groups
/// only).
#[derive(Clone, Copy)]
struct GemmGrid {
    /// Tiles per batch entry and head.
    tiles: (u32, u32),
    /// The 2-D grid of all of them.
    grid: (u32, u32),
    /// The SKINNY path's k split ([`skinny_split`]); `None` off that path.
    split: Option<(u32, bool)>,
}

/// [`GemmGrid`] of `g` with `kernel`, refused where the device cannot dispatch that many.
fn gemm_grid(ctx: &Context, g: &Gemm<'_>, kernel: Kernel, skinny: bool) -> Result<GemmGrid> {
    let split = skinny.then(|| skinny_split(ctx, g)).flatten();
    // SKINNY: tiles_n counts groups of 256 elements of C, or with SKINNY_SPLIT blocks of
    // 256 / K_LANES columns (all rows), per batch entry.
    let (tiles_m, tiles_n) = match (skinny, split) {
        (true, None) => (1, (g.m * g.n).div_ceil(256)),
        (true, Some((lanes, _))) => (1, g.n.div_ceil(256 / lanes)),
        (false, _) => (g.m.div_ceil(kernel.tile_m), g.n.div_ceil(kernel.tile_n)),
    };
    let total = (tiles_m as u64) * (tiles_n as u64) * (g.batch as u64) * (g.heads as u64);
    let grid = ctx.grid_2d_for(
        total,
        "matmul workgroups (batch * tiles of the product)",
        "; split the batch or the rows",
    )?;
    Ok(GemmGrid {
        tiles: (tiles_m, tiles_n),
        grid,
        split,
    })
}

/// Refuses a product the device cannot dispatch, recording nothing: for calls that record several
/// products, so that none is recorded where a later one would be refused.
pub(crate) fn check_gemm(ctx: &Context, g: &Gemm<'_>) -> Result<()> {
    let (kernel, _, skinny) = gemm_plan(ctx, g)?;
    gemm_grid(ctx, g, kernel, skinny).map(|_| ())
}

/// Records one batched product into `pass` (nothing where it is refused).
pub(crate) fn encode_gemm(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    g: &Gemm<'_>,
) -> Result<()> {
    let (kernel, coop, skinny) = gemm_plan(ctx, g)?;
    // Every dispatch below (the k chunks too) has this grid.
    let grid = gemm_grid(ctx, g, kernel, skinny)?;
    if skinny {
        if g.row_sums.is_some() {
            return Err(Error::shape(
                "row_sums",
                "the SKINNY GEMM path has no row sums; sum the rows separately",
            ));
        }
        return encode_one(ctx, pass, g, (SQUARE, None), grid, false, true);
    }
    // llvmpipe ends every loop after 65535 iterations per invocation: split the reduction over
    // groups and k into dispatches that accumulate into C. The bias goes into the first, the
    // activation and residual epilogues into the last, once the sum is complete.
    let k_tiles = (g.k as u64).div_ceil(16);
    let per_k_tile = kernel.loop_cost_per_k_tile;
    let fits = ctx
        .loop_budget()
        .is_none_or(|budget| g.groups as u64 * k_tiles * per_k_tile <= budget as u64);
    if !fits {
        let budget = ctx.loop_budget().unwrap_or(u32::MAX) as u64;
        let k_chunk = ((budget / per_k_tile).max(1) * 16).min(g.k as u64) as u32;
        let mut first = true;
        let chunks = g.groups as usize * (g.k as usize).div_ceil(k_chunk as usize);
        let mut index = 0;
        for group in 0..g.groups {
            for k0 in (0..g.k).step_by(k_chunk as usize) {
                index += 1;
                let last = index == chunks;
                let shift = |op: Operand, k_stride: u32| Operand {
                    offset: op.offset + group * op.stride_g + k0 * k_stride,
                    ..op
                };
                let part = Gemm {
                    k: k_chunk.min(g.k - k0),
                    groups: 1,
                    a: (g.a.0, shift(g.a.1, g.a.1.stride_col)),
                    b: (g.b.0, shift(g.b.1, g.b.1.stride_row)),
                    epilogue: Epilogue {
                        bias: if first { g.epilogue.bias } else { None },
                        activation: if last { g.epilogue.activation } else { None },
                        residual: if last { g.epilogue.residual } else { None },
                    },
                    ..*g
                };
                encode_one(ctx, pass, &part, (kernel, coop), grid, !first, false)?;
                first = false;
            }
        }
        return Ok(());
    }
    encode_one(ctx, pass, g, (kernel, coop), grid, false, false)
}

/// Records one dispatch of `kernel` (with the tensor-core kernel's matrix build, tile group and
/// tiles, [`coop_build`] and [`coop_tiles`], where it is that one) for `g`, over the product's
/// checked `grid`.
fn encode_one(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    g: &Gemm<'_>,
    (kernel, coop): (Kernel, Option<CoopChoice>),
    grid: GemmGrid,
    accumulate: bool,
    skinny: bool,
) -> Result<()> {
    let GemmGrid {
        tiles: (tiles_m, tiles_n),
        grid: (gx, gy),
        split,
    } = grid;
    let total = tiles_m * tiles_n * g.batch * g.heads;
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
        has_bias: g.epilogue.bias.is_some() as u32,
        accumulate: accumulate as u32,
        activation: g.epilogue.activation.map_or(0, |(kind, _, _)| kind.code()),
        activation_grad: g
            .epilogue
            .activation
            .is_some_and(|(_, step, _)| step == ActivationStep::Grad)
            as u32,
        has_residual: g.epilogue.residual.is_some() as u32,
        _pad: 0,
        a: g.a.1,
        b: g.b.1,
        c: g.c.1,
    };
    let mut constants = vec![("ROW_SUMS", g.row_sums.is_some() as u32)];
    if kernel.skinny {
        constants.push(("SKINNY", skinny as u32));
        if let Some((lanes, along_k)) = split {
            constants.push(("SKINNY_SPLIT", 1));
            constants.push(("K_LANES", lanes));
            constants.push(("K_FAST", along_k as u32));
        }
    }
    let names = match kernel.skinny && skinny && split.is_none() {
        true => kernel.cpu_names,
        false => kernel.names,
    };
    let (name, pipeline) = if let Some((build, group, shape)) = coop {
        let tiles = tile_element(ctx);
        let elements = coop_elements(g.elements, tiles);
        constants.push(("SG", group));
        let name = coop_name(build, elements, tiles, shape);
        let source = || coop_source(elements, build, tiles, group, shape);
        (name, ctx.pipeline(name, source, &constants))
    } else {
        let name = names[g.elements.index()];
        let source = || typed_source(kernel.source, g.elements);
        (name, ctx.pipeline(name, source, &constants))
    };
    let empty = ctx.empty_storage();
    let (empty_rw, empty_rw_second) = (ctx.empty_storage_rw(0), ctx.empty_storage_rw(1));
    let epilogue = &g.epilogue;
    let storage = [
        g.a.0.bind(1),
        g.b.0.bind(2),
        g.c.0.bind(3),
        epilogue.bias.unwrap_or(empty.into()).bind(4),
        epilogue.residual.unwrap_or(empty.into()).bind(5),
        epilogue
            .activation
            .map_or(empty_rw.into(), |(_, _, pre)| pre)
            .bind(6),
        g.row_sums.unwrap_or(empty_rw_second.into()).bind(7),
    ];
    let bind_group = ctx.bind_group(&pipeline, name, bytemuck::bytes_of(&params), &storage);
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(gx, gy, 1);
    Ok(())
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![
        uniform_layout!(
            "matmul_strided",
            "GemmParams",
            GemmParams {
                m, n, k, groups, heads, tiles_m, tiles_n, grid_x, total_groups, alpha, has_bias,
                accumulate, activation, activation_grad, has_residual, _pad,
            }
            nested { a, b, c }
        ),
        uniform_layout!(
            "matmul_strided",
            "Operand",
            Operand {
                offset,
                stride_b,
                stride_h,
                head_div,
                stride_g,
                stride_row,
                stride_col,
                _pad
            }
        ),
    ]
}
