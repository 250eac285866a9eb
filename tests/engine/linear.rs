//! Linear layer `y = x W^T + b` on the GPU vs the f64 reference (checked by finite differences):
//! forward with and without bias, dx, dW, db over odd sizes and a 3-D input; split bias sums; the
//! activation and residual epilogues (also over split reductions); both GEMM tile shapes
//! (`GemmTiles`), also on the unfused attention's batched, grouped, transposed products; the f16
//! Linear (f16 storage, f32 arithmetic); the mixed-precision Linear (f16-rounded operands, an f16
//! weight copy, f32 accumulation and results); errors.

use crate::common;

use common::*;
use half::f16;
use wgpu_attention::device::LLVMPIPE_LOOP_BUDGET;
use wgpu_attention::kernels::elementwise::{cast_f16_into, Activation};
use wgpu_attention::kernels::linear::{
    linear_backward, linear_backward_epilogue_into, linear_backward_mixed_into, linear_forward,
    linear_forward_epilogue_into, linear_forward_f16, linear_forward_mixed_into, Epilogue,
    LinearGrads,
};
use wgpu_attention::kernels::matmul::qualify_gemm_build;
use wgpu_attention::kernels::matrix::MatrixBuild;
use wgpu_attention::reference::compare::{product_tolerances, F16_FORWARD_ATOL, F16_RTOL};
use wgpu_attention::reference::elementwise as reference_elementwise;
use wgpu_attention::reference::linear as reference;
use wgpu_attention::{
    attention_backward_unfused, attention_forward_unfused, AttentionOptions, Context, Error,
    GemmTiles, GpuTensor, GpuTensorF16,
};

fn check(backend: &str, ctx: &Context, x_shape: &[usize], out_f: usize, with_bias: bool) {
    let [fwd_atol, fwd_rtol, bwd_atol, bwd_rtol] = gemm_tolerances(ctx);
    let in_f = *x_shape.last().unwrap();
    let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
    let mut rng = rng((rows * 1000 + in_f * 10 + out_f) as u64);
    let x = random(&mut rng, rows * in_f, 1.0);
    let w = random(&mut rng, out_f * in_f, 0.5);
    let b = random(&mut rng, out_f, 0.5);
    let dy = random(&mut rng, rows * out_f, 1.0);
    let mut y_shape = x_shape.to_vec();
    *y_shape.last_mut().unwrap() = out_f;
    let xt = GpuTensor::from_slice(ctx, &x, x_shape).unwrap();
    let wt = GpuTensor::from_slice(ctx, &w, &[out_f, in_f]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &b, &[out_f]).unwrap();
    let dyt = GpuTensor::from_slice(ctx, &dy, &y_shape).unwrap();
    let bias = with_bias.then_some(&bt);
    let y = linear_forward(ctx, &xt, &wt, bias).unwrap();
    assert_eq!(y.shape(), &y_shape[..]);
    let g = linear_backward(ctx, &xt, &wt, &dyt, with_bias).unwrap();
    let b64 = to_f64(&b);
    let ry = reference::linear_forward(
        &to_f64(&x),
        &to_f64(&w),
        with_bias.then_some(&b64[..]),
        in_f,
    );
    let (rdx, rdw, rdb) = reference::linear_backward(&to_f64(&x), &to_f64(&w), &to_f64(&dy), in_f);
    let tag = format!("[{backend}] linear {x_shape:?} -> {out_f} bias {with_bias}");
    assert_close(
        &format!("{tag} y"),
        &y.to_vec(ctx).unwrap(),
        &ry,
        fwd_atol,
        fwd_rtol,
    );
    assert_close(
        &format!("{tag} dx"),
        &g.dx.to_vec(ctx).unwrap(),
        &rdx,
        bwd_atol,
        bwd_rtol,
    );
    assert_close(
        &format!("{tag} d_weight"),
        &g.d_weight.to_vec(ctx).unwrap(),
        &rdw,
        bwd_atol,
        bwd_rtol,
    );
    match &g.d_bias {
        Some(db) => {
            let db = db.to_vec(ctx).unwrap();
            assert_close(&format!("{tag} d_bias"), &db, &rdb, bwd_atol, bwd_rtol);
            // Summed inside the dW product (or by the column-sum kernel on the SKINNY path), rows
            // in order from zero: the same bits as that sum on the host, unless a loop budget
            // split the reduction into dispatches.
            if ctx.loop_budget().is_none_or(|b| b >= LLVMPIPE_LOOP_BUDGET) {
                let in_order: Vec<u32> = (0..out_f)
                    .map(|c| {
                        (0..rows)
                            .fold(0.0f32, |s, r| s + dy[r * out_f + c])
                            .to_bits()
                    })
                    .collect();
                let bits: Vec<u32> = db.iter().map(|x| x.to_bits()).collect();
                assert!(
                    bits == in_order,
                    "{tag}: d_bias is not the in-order row sum"
                );
            }
        }
        None => assert!(!with_bias),
    }
}

#[test]
fn matches_reference_over_odd_sizes() {
    // Both families: the SKINNY path has a form per family (an element per invocation, k split
    // over lanes).
    for_each_family(|backend, ctx| {
        for (x_shape, out_f) in [
            (vec![1, 1], 1),
            (vec![7, 5], 3),
            (vec![33, 64], 17),
            (vec![2, 9, 40], 24),
            (vec![130, 32], 96),
            // A few rows (the SKINNY path), more than 256 elements of the output.
            (vec![3, 40], 300),
        ] {
            for with_bias in [true, false] {
                check(backend, ctx, &x_shape, out_f, with_bias);
            }
        }
    });
}

#[test]
fn long_reductions_split_into_accumulated_dispatches() {
    for_each_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        // 2000 rows > the budget's rows per dispatch: the bias sums and the dW product (k = rows)
        // are both split into accumulating dispatches: the column-sum kernel's (3 outputs, the
        // SKINNY dW) and the tiled dW product's own row sums (12 outputs).
        check(backend, ctx, &[2000, 5], 3, true);
        check(backend, ctx, &[2000, 5], 12, true);
    });
}

/// Forward `y = act(x W^T + b) + r` (and `pre = x W^T + b`), backward
/// `dx = (dy W) * act'(pre) + r`, against the reference linear, activation and sum composed.
fn check_epilogues(backend: &str, ctx: &Context, rows: usize, in_f: usize, out_f: usize) {
    let [fwd_atol, fwd_rtol, bwd_atol, bwd_rtol] = gemm_tolerances(ctx);
    let mut rng = rng((rows * 7919 + in_f * 31 + out_f) as u64);
    let x = random(&mut rng, rows * in_f, 1.0);
    let w = random(&mut rng, out_f * in_f, 0.5);
    let b = random(&mut rng, out_f, 0.5);
    let r_out = random(&mut rng, rows * out_f, 1.0);
    let dy = random(&mut rng, rows * out_f, 1.0);
    let pre_in = random(&mut rng, rows * in_f, 2.0);
    let r_in = random(&mut rng, rows * in_f, 1.0);
    let up = |data: &[f32], shape: &[usize]| GpuTensor::from_slice(ctx, data, shape).unwrap();
    let (xt, wt, bt) = (
        up(&x, &[rows, in_f]),
        up(&w, &[out_f, in_f]),
        up(&b, &[out_f]),
    );
    let (rt_out, dyt) = (up(&r_out, &[rows, out_f]), up(&dy, &[rows, out_f]));
    let (pre_in_t, rt_in) = (up(&pre_in, &[rows, in_f]), up(&r_in, &[rows, in_f]));
    let z = reference::linear_forward(&to_f64(&x), &to_f64(&w), Some(&to_f64(&b)), in_f);
    let (rdx, _, _) = reference::linear_backward(&to_f64(&x), &to_f64(&w), &to_f64(&dy), in_f);
    for kind in [Activation::Relu, Activation::Gelu] {
        let tag = format!("[{backend}] epilogue {kind:?} [{rows}, {in_f}] -> {out_f}");
        let pre = GpuTensor::zeros(ctx, &[rows, out_f]).unwrap();
        let y = GpuTensor::zeros(ctx, &[rows, out_f]).unwrap();
        let grads = LinearGrads {
            dx: GpuTensor::zeros(ctx, &[rows, in_f]).unwrap(),
            d_weight: GpuTensor::zeros(ctx, &[out_f, in_f]).unwrap(),
            d_bias: None,
        };
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let forward = Epilogue {
            activation: Some((kind, &pre)),
            residual: Some(&rt_out),
        };
        linear_forward_epilogue_into(ctx, &mut encoder, &xt, &wt, Some(&bt), forward, &y).unwrap();
        let backward = Epilogue {
            activation: Some((kind, &pre_in_t)),
            residual: Some(&rt_in),
        };
        linear_backward_epilogue_into(ctx, &mut encoder, &xt, &wt, &dyt, &grads, backward).unwrap();
        ctx.queue().submit([encoder.finish()]);
        let ry = reference_elementwise::add(
            &reference_elementwise::activation_forward(kind, &z),
            &to_f64(&r_out),
        );
        let rdx = reference_elementwise::add(
            &reference_elementwise::activation_backward(kind, &to_f64(&pre_in), &rdx),
            &to_f64(&r_in),
        );
        let read = |t: &GpuTensor| t.to_vec(ctx).unwrap();
        assert_close(&format!("{tag} pre"), &read(&pre), &z, fwd_atol, fwd_rtol);
        assert_close(&format!("{tag} y"), &read(&y), &ry, fwd_atol, fwd_rtol);
        let (atol, rtol) = (bwd_atol, bwd_rtol);
        assert_close(&format!("{tag} dx"), &read(&grads.dx), &rdx, atol, rtol);
    }
}

#[test]
fn epilogues_match_reference() {
    for_each_family(|backend, ctx| {
        // Tiled, with partial tiles, and SKINNY (3 rows).
        for (rows, in_f, out_f) in [(70, 33, 20), (3, 40, 300)] {
            check_epilogues(backend, ctx, rows, in_f, out_f);
        }
    });
    // Reductions split into accumulating dispatches (forward k = 2000, backward k = 1600): the
    // activation and residual apply once, after the last.
    for_each_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        check_epilogues(backend, ctx, 9, 2000, 7);
        check_epilogues(backend, ctx, 9, 6, 1600);
    });
}

/// Both GEMM kernels, whichever the adapter picks by default.
const TILES: [GemmTiles; 2] = [GemmTiles::Square64, GemmTiles::Wide128x64];

/// The forward and backward tolerances `[atol, rtol, atol, rtol]` of `ctx`'s GEMM: f32's, or with
/// the tensor-core tiles (f32 operands rounded to f16 in workgroup memory) the tensor-core family's.
fn gemm_tolerances(ctx: &Context) -> [f64; 4] {
    product_tolerances(ctx.gemm_tiles().is_coop())
}

/// The tensor-core tiles (their portable build here), 64 x 64 and 128 x 128: the products of
/// Linear layers of odd sizes, every epilogue, row sums (the bias gradient), reductions split under
/// a loop budget, f16 storage, the unfused attention's batched, grouped, transposed products, and
/// the smaller tiles where the device's limits leave no room for the larger.
#[test]
fn tensor_core_gemm_matches_reference() {
    for tiles in [GemmTiles::Coop64, GemmTiles::Coop128] {
        let coop = |ctx: &mut Context| ctx.set_gemm_tiles(Some(tiles));
        for_each_backend_with(coop, |backend, ctx| {
            // The qualification a device with cooperative matrices runs, here with the portable
            // build.
            if tiles == GemmTiles::Coop64 {
                let mismatch = qualify_gemm_build(ctx, MatrixBuild::Portable).unwrap();
                assert_eq!(mismatch, None, "{backend}");
            }
            check_tiles(backend, ctx);
            check(backend, ctx, &[3, 40], 70, true);
            if ctx.device().features().contains(wgpu::Features::SHADER_F16) {
                check_f16(backend, ctx, &[130, 33], 96, true);
                check_f16(backend, ctx, &[2, 100, 64], 65, false);
            }
        });
        let with_budget = |ctx: &mut Context| {
            ctx.set_gemm_tiles(Some(tiles));
            ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET));
        };
        for_each_backend_with(with_budget, |backend, ctx| {
            check_epilogues(backend, ctx, 130, 700, 7);
            check_epilogues(backend, ctx, 130, 6, 600);
        });
    }
    // WebGPU's default 16 KiB of workgroup storage holds the 64 x 64 tiles in f16 (14.5 KiB) but
    // not the 128 x 128 ones, which run as 64 x 64 there (with f32 tiles, neither fits: the
    // square kernel runs).
    let coop128 = |ctx: &mut Context| ctx.set_gemm_tiles(Some(GemmTiles::Coop128));
    for_each_backend_with_storage_and(16384, coop128, |backend, ctx| {
        check(backend, ctx, &[130, 32], 96, true);
    });
    assert_eq!(GemmTiles::parse("coop").unwrap(), GemmTiles::Coop);
    assert_eq!(GemmTiles::parse("coop128").unwrap().name(), "coop128");
}

#[test]
fn both_gemm_tiles_match_reference() {
    for tiles in TILES {
        let forced = |ctx: &mut Context| ctx.set_gemm_tiles(Some(tiles));
        for_each_backend_with(forced, check_tiles);
        // Reductions split into accumulating dispatches under a loop budget.
        let with_budget = |ctx: &mut Context| {
            ctx.set_gemm_tiles(Some(tiles));
            ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET));
        };
        for_each_backend_with(with_budget, |backend, ctx| {
            check_epilogues(backend, ctx, 130, 2000, 7);
            check_epilogues(backend, ctx, 130, 6, 1600);
        });
    }
}

/// Products of at least 128 rows (dx and the forward; dW has 130 rows in the last shape): partial
/// tiles, both operand layouts of A and B, the epilogues, and the unfused attention's batched,
/// grouped (GQA), transposed products with alpha.
fn check_tiles(backend: &str, ctx: &Context) {
    let [fwd_atol, fwd_rtol, bwd_atol, bwd_rtol] = gemm_tolerances(ctx);
    for (x_shape, out_f) in [
        (vec![130, 32], 96),
        (vec![2, 100, 40], 70),
        (vec![257, 65], 130),
    ] {
        check(backend, ctx, &x_shape, out_f, true);
    }
    check_epilogues(backend, ctx, 200, 33, 20);
    let case = Case::new(1, 130, 140, 4, 2, 24, 40).causal();
    let [q, k, v, d_out] = case.upload(ctx);
    let opts = AttentionOptions::new().causal(true);
    let fwd = attention_forward_unfused(ctx, &q, &k, &v, &opts).unwrap();
    let (ref_out, _) = case.reference_forward();
    let tiles = ctx.gemm_tiles().name();
    let tag = format!("[{backend}] {tiles} unfused {}", case.label());
    let out = fwd.out.to_vec(ctx).unwrap();
    assert_close(&format!("{tag} out"), &out, &ref_out, fwd_atol, fwd_rtol);
    let g = attention_backward_unfused(ctx, &q, &k, &v, &d_out, &opts).unwrap();
    let r = case.reference_backward();
    for (name, gpu, reference) in [
        ("dq", &g.dq, &r.dq),
        ("dk", &g.dk, &r.dk),
        ("dv", &g.dv, &r.dv),
    ] {
        let gpu = gpu.to_vec(ctx).unwrap();
        assert_close(
            &format!("{tag} {name}"),
            &gpu,
            reference,
            bwd_atol,
            bwd_rtol,
        );
    }
}

#[test]
fn epilogue_tensors_are_checked() {
    for_each_backend(|_, ctx| {
        let x = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        let w = GpuTensor::zeros(ctx, &[3, 8]).unwrap();
        let y = GpuTensor::zeros(ctx, &[4, 3]).unwrap();
        let wrong = GpuTensor::zeros(ctx, &[4, 4]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let mut forward =
            |epilogue| linear_forward_epilogue_into(ctx, &mut encoder, &x, &w, None, epilogue, &y);
        let pre_shape = Epilogue {
            activation: Some((Activation::Gelu, &wrong)),
            residual: None,
        };
        assert!(matches!(
            forward(pre_shape),
            Err(Error::Shape { arg: "pre", .. })
        ));
        let pre_is_y = Epilogue {
            activation: Some((Activation::Gelu, &y)),
            residual: None,
        };
        assert!(matches!(
            forward(pre_is_y),
            Err(Error::Shape { arg: "pre", .. })
        ));
        let residual_is_y = Epilogue {
            activation: None,
            residual: Some(&y),
        };
        assert!(matches!(
            forward(residual_is_y),
            Err(Error::Shape {
                arg: "residual",
                ..
            })
        ));
    });
}

#[test]
fn bad_shapes_are_typed_errors() {
    for_each_backend(|_, ctx| {
        let x = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        let w = GpuTensor::zeros(ctx, &[3, 7]).unwrap();
        assert!(matches!(
            linear_forward(ctx, &x, &w, None),
            Err(Error::Shape { arg: "x", .. })
        ));
        let w = GpuTensor::zeros(ctx, &[3, 8]).unwrap();
        let b = GpuTensor::zeros(ctx, &[4]).unwrap();
        assert!(matches!(
            linear_forward(ctx, &x, &w, Some(&b)),
            Err(Error::Shape { arg: "bias", .. })
        ));
    });
}

#[test]
fn reference_backward_matches_finite_differences() {
    let (rows, in_f, out_f) = (3, 4, 2);
    let x: Vec<f64> = (0..rows * in_f).map(|i| (i as f64 * 0.37).sin()).collect();
    let w: Vec<f64> = (0..out_f * in_f).map(|i| (i as f64 * 0.71).cos()).collect();
    let b = vec![0.1, -0.2];
    let dy: Vec<f64> = (0..rows * out_f).map(|i| (i as f64 * 1.3).sin()).collect();
    let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
        reference::linear_forward(x, w, Some(b), in_f)
            .iter()
            .zip(&dy)
            .map(|(a, g)| a * g)
            .sum()
    };
    let (dx, dw, db) = reference::linear_backward(&x, &w, &dy, in_f);
    let h = 1e-6;
    let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
    for i in 0..x.len() {
        let d = fd(&|e| {
            let mut x2 = x.clone();
            x2[i] += e;
            loss(&x2, &w, &b)
        });
        assert!((d - dx[i]).abs() < 1e-8, "dx[{i}]");
    }
    for i in 0..w.len() {
        let d = fd(&|e| {
            let mut w2 = w.clone();
            w2[i] += e;
            loss(&x, &w2, &b)
        });
        assert!((d - dw[i]).abs() < 1e-8, "dw[{i}]");
    }
    for i in 0..b.len() {
        let d = fd(&|e| {
            let mut b2 = b.clone();
            b2[i] += e;
            loss(&x, &w, &b2)
        });
        assert!((d - db[i]).abs() < 1e-8, "db[{i}]");
    }
}

/// `linear_forward_f16` (f16 x, weight and y; f32 arithmetic and bias) against the f64 reference on
/// the f16-rounded inputs, within one f16 rounding of the result (`F16_RTOL`, `F16_FORWARD_ATOL`).
fn check_f16(backend: &str, ctx: &Context, x_shape: &[usize], out_f: usize, with_bias: bool) {
    let in_f = *x_shape.last().unwrap();
    let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
    let mut rng = rng((rows * 1000 + in_f * 10 + out_f) as u64 + 16);
    let round =
        |v: Vec<f32>| -> Vec<f32> { v.iter().map(|&x| f16::from_f32(x).to_f32()).collect() };
    let x = round(random(&mut rng, rows * in_f, 1.0));
    let w = round(random(&mut rng, out_f * in_f, 0.5));
    let b = random(&mut rng, out_f, 0.5);
    let xt = GpuTensorF16::from_f32(ctx, &x, x_shape).unwrap();
    let wt = GpuTensorF16::from_f32(ctx, &w, &[out_f, in_f]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &b, &[out_f]).unwrap();
    let y = linear_forward_f16(ctx, &xt, &wt, with_bias.then_some(&bt)).unwrap();
    let mut y_shape = x_shape.to_vec();
    *y_shape.last_mut().unwrap() = out_f;
    assert_eq!(y.shape(), &y_shape[..]);
    let b64 = to_f64(&b);
    let ry = reference::linear_forward(
        &to_f64(&x),
        &to_f64(&w),
        with_bias.then_some(&b64[..]),
        in_f,
    );
    let tiles = ctx.gemm_tiles().name();
    assert_close(
        &format!("[{backend}] {tiles} f16 linear {x_shape:?} -> {out_f} bias {with_bias}"),
        &y.to_vec(ctx).unwrap(),
        &ry,
        F16_FORWARD_ATOL,
        F16_RTOL,
    );
}

#[test]
fn f16_linear_matches_reference() {
    for tiles in TILES {
        for_each_family_with(
            |ctx| ctx.set_gemm_tiles(Some(tiles)),
            |backend, ctx| {
                if !ctx.device().features().contains(wgpu::Features::SHADER_F16) {
                    let xt = GpuTensorF16::zeros(ctx, &[3, 4]).unwrap();
                    let wt = GpuTensorF16::zeros(ctx, &[5, 4]).unwrap();
                    let e = linear_forward_f16(ctx, &xt, &wt, None).unwrap_err();
                    assert!(matches!(e, Error::MissingFeature { .. }), "[{backend}] {e}");
                    return;
                }
                // A decoding step's rows (SKINNY), partial 64- and 128-row tiles, odd widths.
                check_f16(backend, ctx, &[3, 40], 70, true);
                check_f16(backend, ctx, &[130, 33], 96, true);
                check_f16(backend, ctx, &[2, 100, 64], 65, false);
            },
        );
    }
    // A reduction split into accumulating dispatches under a loop budget.
    for_each_backend_with(
        |ctx| ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET)),
        |backend, ctx| {
            if ctx.device().features().contains(wgpu::Features::SHADER_F16) {
                check_f16(backend, ctx, &[130, 2000], 7, true);
            }
        },
    );
}

/// The mixed-precision Linear: forward, dx, dW and db with `x` and `dy` rounded to f16 as the
/// products read them and the f16 copy of the weight (made on the GPU by `cast_f16_into`), f32
/// accumulation. Against the f64 reference of the f16-rounded operands within the f32 products'
/// tolerance (so the rounding is exactly f16's, to nearest), and against the reference of the f32
/// operands within the tensor-core bound SPEC.md states for mixed precision.
fn check_mixed(backend: &str, ctx: &Context, x_shape: &[usize], out_f: usize, with_bias: bool) {
    let in_f = *x_shape.last().unwrap();
    let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
    let mut rng = rng((rows * 1000 + in_f * 10 + out_f) as u64 + 32);
    let x = random(&mut rng, rows * in_f, 1.0);
    let w = random(&mut rng, out_f * in_f, 0.5);
    let b = random(&mut rng, out_f, 0.5);
    let dy = random(&mut rng, rows * out_f, 1.0);
    let mut y_shape = x_shape.to_vec();
    *y_shape.last_mut().unwrap() = out_f;
    let xt = GpuTensor::from_slice(ctx, &x, x_shape).unwrap();
    let wt = GpuTensor::from_slice(ctx, &w, &[out_f, in_f]).unwrap();
    let w16 = GpuTensorF16::zeros(ctx, &[out_f, in_f]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &b, &[out_f]).unwrap();
    let dyt = GpuTensor::from_slice(ctx, &dy, &y_shape).unwrap();
    let y = GpuTensor::zeros(ctx, &y_shape).unwrap();
    let grads = LinearGrads {
        dx: GpuTensor::zeros(ctx, x_shape).unwrap(),
        d_weight: GpuTensor::zeros(ctx, &[out_f, in_f]).unwrap(),
        d_bias: with_bias.then(|| GpuTensor::zeros(ctx, &[out_f]).unwrap()),
    };
    let bias = with_bias.then_some(&bt);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    cast_f16_into(ctx, &mut encoder, &wt, &w16).unwrap();
    linear_forward_mixed_into(ctx, &mut encoder, &xt, &w16, bias, Epilogue::default(), &y).unwrap();
    linear_backward_mixed_into(
        ctx,
        &mut encoder,
        &xt,
        &w16,
        &dyt,
        &grads,
        Epilogue::default(),
    )
    .unwrap();
    ctx.submit(encoder).unwrap();
    let round = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| f16::from_f32(x).to_f64()).collect() };
    let b64 = to_f64(&b);
    let tag = format!(
        "[{backend}] {} mixed linear {x_shape:?} -> {out_f} bias {with_bias}",
        ctx.gemm_tiles().name()
    );
    let outputs = [
        ("y", y.to_vec(ctx).unwrap()),
        ("dx", grads.dx.to_vec(ctx).unwrap()),
        ("d_weight", grads.d_weight.to_vec(ctx).unwrap()),
    ];
    let [atol, rtol, ..] = product_tolerances(false);
    let [mixed_atol, mixed_rtol, ..] = product_tolerances(true);
    for rounded in [true, false] {
        let operands = |v: &[f32]| if rounded { round(v) } else { to_f64(v) };
        let (x64, w64, dy64) = (operands(&x), operands(&w), operands(&dy));
        let ry = reference::linear_forward(&x64, &w64, with_bias.then_some(&b64[..]), in_f);
        let (rdx, rdw, _) = reference::linear_backward(&x64, &w64, &dy64, in_f);
        let (atol, rtol) = match rounded {
            true => (atol, rtol),
            false => (mixed_atol, mixed_rtol),
        };
        let which = if rounded {
            "rounded operands"
        } else {
            "f32 operands"
        };
        for ((name, got), want) in outputs.iter().zip([ry, rdx, rdw]) {
            assert_close(&format!("{tag} {name} vs {which}"), got, &want, atol, rtol);
        }
    }
    if let Some(db) = &grads.d_bias {
        // Summed in f32 from dy as stored or as the product read it: within the mixed bound.
        let (_, _, rdb) = reference::linear_backward(&to_f64(&x), &to_f64(&w), &to_f64(&dy), in_f);
        let got = db.to_vec(ctx).unwrap();
        assert_close(&format!("{tag} d_bias"), &got, &rdb, mixed_atol, mixed_rtol);
    }
}

#[test]
fn mixed_linear_matches_reference() {
    for tiles in [
        GemmTiles::Square64,
        GemmTiles::Wide128x64,
        GemmTiles::Coop64,
    ] {
        for_each_family_with(
            |ctx| ctx.set_gemm_tiles(Some(tiles)),
            |backend, ctx| {
                if !ctx.device().features().contains(wgpu::Features::SHADER_F16) {
                    let x = GpuTensor::zeros(ctx, &[3, 4]).unwrap();
                    let (w16, y) = (GpuTensorF16::zeros(ctx, &[5, 4]).unwrap(), &x);
                    let mut encoder = ctx.device().create_command_encoder(&Default::default());
                    let e = linear_forward_mixed_into(
                        ctx,
                        &mut encoder,
                        &x,
                        &w16,
                        None,
                        Epilogue::default(),
                        y,
                    )
                    .unwrap_err();
                    assert!(matches!(e, Error::MissingFeature { .. }), "[{backend}] {e}");
                    return;
                }
                // A decoding step's rows (SKINNY), partial 64- and 128-row tiles, odd widths.
                check_mixed(backend, ctx, &[3, 40], 70, true);
                check_mixed(backend, ctx, &[130, 33], 96, true);
                if tiles == GemmTiles::Square64 {
                    check_mixed(backend, ctx, &[2, 100, 64], 65, false);
                }
            },
        );
    }
}
