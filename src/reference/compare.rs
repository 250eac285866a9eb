//! The tolerances of SPEC.md and the elementwise comparison every GPU result is judged by, shared by
//! the tests and the benchmark's validation.

/// Forward (O, lse): `|gpu - ref| <= atol * max(1, max|ref|) + rtol * |ref|`.
pub const FORWARD_RTOL: f64 = 1e-4;
/// Forward absolute tolerance against the f64 reference.
pub const FORWARD_ATOL: f64 = 1e-5;
/// Backward (dQ, dK, dV).
pub const BACKWARD_RTOL: f64 = 1e-3;
/// Backward absolute tolerance.
pub const BACKWARD_ATOL: f64 = 1e-4;
/// f16 storage (inputs rounded to f16 before the reference sees them; f32 arithmetic on the GPU):
/// an f16 output is one rounding (unit roundoff 2^-11) from the f32 result, so `rtol = 2^-10`
/// leaves a factor 2 for the f32 arithmetic before it. Forward O: `atol = 2^-12` of the largest
/// `|O|` for values near zero. Backward: `atol = 2^-9` of the largest gradient, because
/// `D = rowsum(dO * O)` is computed from the f16-rounded O (a relative error up to 2^-11 in D, which
/// enters dQ and dK at the scale of the largest dS terms). lse stays f32 (the forward tolerances).
pub const F16_RTOL: f64 = 1.0 / 1024.0;
/// Forward absolute tolerance of f16 inputs and outputs (one f16 rounding of values near 1).
pub const F16_FORWARD_ATOL: f64 = 1.0 / 4096.0;
/// Backward absolute tolerance of f16 inputs and gradients.
pub const F16_BACKWARD_ATOL: f64 = 1.0 / 512.0;

/// The tensor-core kernel family ([`crate::KernelFamily::Coop`]) on f32 inputs: Q (scaled), K, V and
/// P are rounded to f16 (unit roundoff 2^-11) before the tile products, which the reference does
/// not do; each rounding moves a score or an output by up to 2^-11 relatively, and a handful add up
/// in O and lse, so `2^-8` (a factor 2 over four roundings), relative and of the largest value.
pub const TENSOR_CORE_RTOL: f64 = 1.0 / 256.0;
/// Absolute tolerance of the tensor-core family (of the largest `|value|`, at least 1).
pub const TENSOR_CORE_ATOL: f64 = 1.0 / 256.0;

/// The forward and backward tolerances `[atol, rtol, atol, rtol]` of a product run on f32
/// operands: f32's, or with `tensor_cores` (operands rounded to f16 before the tile products, as
/// `GemmTiles::Coop` does) the tensor-core family's.
pub fn product_tolerances(tensor_cores: bool) -> [f64; 4] {
    match tensor_cores {
        true => [
            TENSOR_CORE_ATOL,
            TENSOR_CORE_RTOL,
            TENSOR_CORE_ATOL,
            TENSOR_CORE_RTOL,
        ],
        false => [FORWARD_ATOL, FORWARD_RTOL, BACKWARD_ATOL, BACKWARD_RTOL],
    }
}

/// The worst element of a comparison.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Comparison {
    /// Largest `|gpu - ref|`.
    pub worst_abs: f64,
    /// Largest `|gpu - ref| / (atol + rtol * |ref|)`: at most 1 passes; infinite for NaN, a length
    /// mismatch or a `-inf` reference not matched exactly.
    pub worst_ratio: f64,
    /// Index of the element with the largest ratio.
    pub index: usize,
}

impl Comparison {
    /// Whether every element was within tolerance.
    pub fn passed(&self) -> bool {
        self.worst_ratio <= 1.0
    }
}

/// Compares `gpu` with `reference` elementwise with atol scaled by `max(1, max|ref|)`.
pub fn compare(gpu: &[f32], reference: &[f64], atol: f64, rtol: f64) -> Comparison {
    if gpu.len() != reference.len() {
        return Comparison {
            worst_abs: f64::INFINITY,
            worst_ratio: f64::INFINITY,
            index: gpu.len().min(reference.len()),
        };
    }
    let max_ref = reference
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let atol = atol * max_ref.max(1.0);
    let mut worst = Comparison::default();
    for (i, (&g, &r)) in gpu.iter().zip(reference).enumerate() {
        let g = g as f64;
        let (err, ratio) = if r.is_infinite() {
            if g == r {
                (0.0, 0.0)
            } else {
                (f64::INFINITY, f64::INFINITY)
            }
        } else if g.is_nan() {
            (f64::INFINITY, f64::INFINITY)
        } else {
            let err = (g - r).abs();
            (err, err / (atol + rtol * r.abs()))
        };
        if ratio > worst.worst_ratio || (ratio.is_infinite() && !worst.worst_ratio.is_infinite()) {
            worst = Comparison {
                worst_abs: err,
                worst_ratio: ratio,
                index: i,
            };
        }
    }
    worst
}
