//! What the device's cooperative matrices compute: each load/store layout from storage memory, and
//! the tensor-core attention's two products exactly as its matrix interface
//! (`shaders/matrix/cooperative.wgsl`) runs them from workgroup memory, checked against the CPU. The
//! tensor-core family qualifies itself on a device before use; when it does not, this names which
//! primitive differs (one line per probe: the worst error, and which product the result matches).
//!
//!     cargo run --release --example coop_probe [-- --check]
//!
//! `--check` only validates every probe's WGSL with naga (no device needed).
//!
//! Adapter selection: WGPU_BACKEND=vulkan|metal, WGPU_ADAPTER_NAME=<substring>.

use std::process::ExitCode;

use half::f16;
use wgpu::util::DeviceExt;
use wgpu_attention::Context;

const MATRIX_COOP: &str = include_str!("../shaders/matrix/cooperative.wgsl");
/// The reduction length and the columns of B (and C) of the workgroup probes (16 rows).
const K: usize = 64;
const N: usize = 64;

/// A 16 x 16 row-major matrix product, `x` and `y` (de)transposed as asked.
fn product(x: &[f32], xt: bool, y: &[f32], yt: bool) -> Vec<f32> {
    let at = |m: &[f32], t: bool, r: usize, c: usize| if t { m[c * 16 + r] } else { m[r * 16 + c] };
    let mut out = vec![0.0; 256];
    for r in 0..16 {
        for c in 0..16 {
            out[r * 16 + c] = (0..16).map(|k| at(x, xt, r, k) * at(y, yt, k, c)).sum();
        }
    }
    out
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Small multiples of 1/8, so every product and sum is exact in f16 x f16 -> f32.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            ((x >> 24) % 17) as f32 / 8.0 - 1.0
        })
        .collect()
}

/// Runs `source` (entry `main`, one workgroup of `wg`) on `a`, `b` (f16) and returns `out_len`
/// f32 values of binding 2.
fn run(
    ctx: &Context,
    source: &str,
    a: &[f32],
    b: &[f32],
    out_len: usize,
    constants: &[(&str, f64)],
) -> Result<Vec<f32>, String> {
    let device = ctx.device();
    let half = |v: &[f32]| v.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>();
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("coop_probe"),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("coop_probe"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants,
            ..Default::default()
        },
        cache: None,
    });
    let input = |data: &[f16]| {
        device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(data),
            usage: wgpu::BufferUsages::STORAGE,
        })
    };
    let (a_buf, b_buf) = (input(&half(a)), input(&half(b)));
    let size = (out_len * 4) as u64;
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let layout = pipeline.get_bind_group_layout(0);
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: a_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: b_buf.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: out.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    encoder.copy_buffer_to_buffer(&out, 0, &read, 0, size);
    ctx.queue().submit([encoder.finish()]);
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(e.to_string());
    }
    read.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| e.to_string())?;
    let data = read.slice(..).get_mapped_range().unwrap();
    Ok(bytemuck::cast_slice::<u8, f32>(&data).to_vec())
}

const HEADER: &str = "enable f16;\nenable wgpu_cooperative_matrix;\n\
@group(0) @binding(0) var<storage, read> a_in: array<f16>;\n\
@group(0) @binding(1) var<storage, read> b_in: array<f16>;\n\
@group(0) @binding(2) var<storage, read_write> c_out: array<f32>;\n";

/// One 16 x 16 x 16 product straight from storage memory with the given loads and store.
fn storage_probe(wg: u32, load_a: &str, load_b: &str, store: &str) -> String {
    format!(
        "{HEADER}@compute @workgroup_size({wg})\nfn main() {{\n\
         let a = {load_a}<coop_mat16x16<f16, A>>(&a_in[0], 16u);\n\
         let b = {load_b}<coop_mat16x16<f16, B>>(&b_in[0], 16u);\n\
         let c = coopMultiplyAdd(a, b, coop_mat16x16<f32, C>());\n\
         {store}(c, &c_out[0], 16u);\n}}\n"
    )
}

/// The attention kernel's S = Q K^T (A: Q rows, B: K rows loaded transposed, K/16 steps) or
/// P V (B: V rows, N/16 output tiles) through the matrix interface, from workgroup memory at the
/// kernel's offsets and strides; with `overrides`, the workgroup size and the arrays' lengths are
/// override constants, as in the kernel.
fn workgroup_probe(wg: u32, scores: bool, overrides: bool, extras: Extras) -> String {
    let body = if scores {
        // mat_mem: Q [16 x K] at 0, K [16 x K] at 16 K; acc_mem: S [16 x 16].
        "    var s = mat_zero();\n\
         for (var d0 = 0u; d0 < KD; d0 += 16u) {\n\
             s = mat_mma(mat_load_a(d0, KD), mat_load_b_transposed(16u * KD + d0, KD), s);\n\
         }\n\
         mat_store(s, 0u, 16u);\n"
    } else {
        // mat_mem: P [16 x 16] at 0, V [16 x N] at 256; acc_mem: P V [16 x N] at 256.
        "    let p = mat_load_a(0u, 16u);\n\
         for (var c0 = 0u; c0 < ND; c0 += 16u) {\n\
             mat_store(mat_mma(p, mat_load_b(256u + c0, ND), mat_zero()), 256u + c0, ND);\n\
         }\n"
    };
    let (a_len, b_len, out_len) = match scores {
        true => ("16u * KD", "16u * KD", "256u"),
        false => ("256u", "16u * ND", "16u * ND"),
    };
    let out_at = if scores { "0u" } else { "256u" };
    let (mat, acc) = (16 * K + 16 * K.max(N), 256 + 16 * N);
    let sizes = match overrides {
        true => format!(
            "override WG: u32 = 1u;\noverride MAT_MEM: u32 = {mat}u;\noverride ACC_MEM: u32 = {acc}u;\n"
        ),
        false => format!("const WG: u32 = {wg}u;\nconst MAT_MEM: u32 = {mat}u;\nconst ACC_MEM: u32 = {acc}u;\n"),
    };
    let (declare, touch) = match extras {
        Extras::None => ("", ""),
        Extras::Small => (
            "var<workgroup> row_m: array<f32, 16>;\nvar<workgroup> row_l: array<f32, 16>;\n\
             var<workgroup> flag: atomic<u32>;\nvar<workgroup> flag_tile: u32;\n",
            "if lid < 16u { row_m[lid] = 1.0; row_l[lid] = 2.0; }\n\
             if lid == 0u { atomicStore(&flag, 1u); flag_tile = 1u; }\n",
        ),
        Extras::Padded => (
            "var<workgroup> row_m: array<f32, 16>;\nvar<workgroup> row_l: array<f32, 16>;\n\
             var<workgroup> flag: array<atomic<u32>, 4>;\nvar<workgroup> flag_tile: array<u32, 4>;\n",
            "if lid < 16u { row_m[lid] = 1.0; row_l[lid] = 2.0; }\n\
             if lid == 0u { atomicStore(&flag[0], 1u); flag_tile[0] = 1u; }\n",
        ),
    };
    let out_extra = match extras {
        Extras::None => "",
        Extras::Small => "let ft = workgroupUniformLoad(&flag_tile);\nif lid == 0u && ft != 1u { c_out[0] = row_m[0] + row_l[1]; }\n",
        Extras::Padded => "let ft = workgroupUniformLoad(&flag_tile[0]);\nif lid == 0u && ft != 1u { c_out[0] = row_m[0] + row_l[1]; }\n",
    };
    format!(
        "{HEADER}alias MatElem = f16;\nconst KD: u32 = {K}u;\nconst ND: u32 = {N}u;\n{sizes}{declare}\
         var<workgroup> mat_mem: array<f16, MAT_MEM>;\n\
         var<workgroup> acc_mem: array<f32, ACC_MEM>;\n\
         @compute @workgroup_size(WG)\n\
         fn main(@builtin(local_invocation_index) lid: u32) {{\n\
         mat_init(lid);\n{touch}\
         let a_len = {a_len};\n\
         for (var t = lid; t < a_len; t += WG) {{ mat_mem[t] = a_in[t]; }}\n\
         for (var t = lid; t < {b_len}; t += WG) {{ mat_mem[a_len + t] = b_in[t]; }}\n\
         workgroupBarrier();\n\
         {body}\
         workgroupBarrier();\n\
         for (var t = lid; t < {out_len}; t += WG) {{ c_out[t] = acc_mem[{out_at} + t]; }}\n\
         {out_extra}}}\n{MATRIX_COOP}"
    )
}

/// Workgroup variables beside the tiles: none, the attention kernel's small ones as they were
/// (4-byte flags), or padded to 16 bytes each.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Extras {
    None,
    Small,
    Padded,
}

/// The workgroup probes: (scores or P V, override-sized arrays, extra variables).
const WORKGROUP_PROBES: [(bool, bool, Extras); 8] = [
    (true, false, Extras::None),
    (false, false, Extras::None),
    (true, true, Extras::None),
    (false, true, Extras::None),
    (true, true, Extras::Small),
    (false, true, Extras::Small),
    (true, true, Extras::Padded),
    (false, true, Extras::Padded),
];

/// The storage probes at workgroup size `wg`: every load and store layout, named.
fn storage_probes(wg: u32) -> Vec<(String, String)> {
    let mut all = Vec::new();
    for load_a in ["coopLoad", "coopLoadT"] {
        for load_b in ["coopLoad", "coopLoadT"] {
            for store in ["coopStore", "coopStoreT"] {
                all.push((
                    format!("storage wg {wg}: {load_a} A, {load_b} B, {store} C"),
                    storage_probe(wg, load_a, load_b, store),
                ));
            }
        }
    }
    all
}

/// Every probe's source at the workgroup sizes `wgs`.
fn sources(wgs: &[u32]) -> Vec<String> {
    let mut all = Vec::new();
    for &wg in wgs {
        all.extend(storage_probes(wg).into_iter().map(|(_, source)| source));
        for (scores, overrides, extras) in WORKGROUP_PROBES {
            all.push(workgroup_probe(wg, scores, overrides, extras));
        }
    }
    all
}

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--check") {
        for source in sources(&[32, 64]) {
            let module = match naga::front::wgsl::parse_str(&source) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("{}", e.emit_to_string(&source));
                    return ExitCode::FAILURE;
                }
            };
            let caps = naga::valid::Capabilities::all();
            if let Err(e) = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                .validate(&module)
            {
                eprintln!("{}", e.emit_to_string(&source));
                return ExitCode::FAILURE;
            }
        }
        println!("every probe validates");
        return ExitCode::SUCCESS;
    }
    let ctx = match Context::new() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = ctx.report();
    println!("adapter: {} ({:?})", report.name, report.backend);
    println!("cooperative matrices: {:?}", report.cooperative_matrices);
    let features = ctx.device().features();
    if !features
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16)
    {
        println!("the device has no cooperative matrices (or no f16): nothing to probe");
        return ExitCode::SUCCESS;
    }
    let sub = ctx.device().adapter_info().subgroup_min_size;
    let wgs = [sub, 2 * sub];
    println!("subgroup size {sub}; probes at workgroups {wgs:?}");

    let (a, b) = (values(256, 1), values(256, 2));
    let candidates: Vec<(String, Vec<f32>)> = [false, true]
        .iter()
        .flat_map(|&xt| [false, true].map(move |yt| (xt, yt)))
        .flat_map(|(xt, yt)| {
            let (x, y) = (if xt { "A^T" } else { "A" }, if yt { "B^T" } else { "B" });
            [
                (format!("{x} {y}"), product(&a, xt, &b, yt)),
                (format!("{y} {x}"), product(&b, yt, &a, xt)),
            ]
        })
        .collect();
    let mut failed = false;
    for wg in wgs {
        for (name, source) in storage_probes(wg) {
            match run(&ctx, &source, &a, &b, 256, &[]) {
                Ok(c) => {
                    let matches: Vec<&str> = candidates
                        .iter()
                        .filter(|(_, want)| worst(&c, want) == 0.0)
                        .map(|(n, _)| n.as_str())
                        .collect();
                    let err = worst(&c, &candidates[0].1);
                    println!("{name}: |C - A B| {err:e}, equals {matches:?}");
                }
                Err(e) => println!("{name}: error: {e}"),
            }
        }
        for (scores, overrides, extras) in WORKGROUP_PROBES {
            let (rows_a, rows_b) = (16 * K, 16 * if scores { K } else { N });
            let (x, y) = (values(rows_a.max(256), 3), values(rows_b, 4));
            let (a_len, out_len) = if scores { (16 * K, 256) } else { (256, 16 * N) };
            let want: Vec<f32> = if scores {
                // S[r][n] = sum_d Q[r][d] K[n][d]
                (0..256)
                    .map(|e| {
                        (0..K)
                            .map(|d| x[(e / 16) * K + d] * y[(e % 16) * K + d])
                            .sum()
                    })
                    .collect()
            } else {
                // (P V)[r][c] = sum_j P[r][j] V[j][c]
                (0..16 * N)
                    .map(|e| {
                        (0..16)
                            .map(|j| x[(e / N) * 16 + j] * y[j * N + e % N])
                            .sum()
                    })
                    .collect()
            };
            let name = format!(
                "workgroup wg {wg}{}{}: the attention's {} through matrix/cooperative.wgsl",
                if overrides { " (override sizes)" } else { "" },
                match extras {
                    Extras::None => "",
                    Extras::Small => " (with 4-byte variables)",
                    Extras::Padded => " (with variables padded to 16 bytes)",
                },
                if scores { "S = Q K^T" } else { "P V" }
            );
            let constants = [("WG", f64::from(wg))];
            let constants = if overrides { &constants[..] } else { &[] };
            let source = workgroup_probe(wg, scores, overrides, extras);
            match run(&ctx, &source, &x[..a_len], &y, out_len, constants) {
                Ok(c) => {
                    let err = worst(&c, &want);
                    let off = c.iter().zip(&want).filter(|(p, q)| p != q).count();
                    failed |= err != 0.0;
                    println!(
                        "{name}: worst error {err:e}, {off} of {} elements off",
                        want.len()
                    );
                }
                Err(e) => {
                    failed = true;
                    println!("{name}: error: {e}")
                }
            }
        }
    }
    match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    }
}
