// The CPU-driver fused backward's gradients, as bits, for four cases: build against two commits
// (a path dependency on the work tree) and `cmp` the two files.
use std::io::Write;
use wgpu_attention::*;

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n).map(|_| { x ^= x << 13; x ^= x >> 17; x ^= x << 5; (x as f32 / u32::MAX as f32) * 2.0 - 1.0 }).collect()
}

fn main() {
    let out = std::env::args().nth(1).unwrap();
    let mut f = std::fs::File::create(out).unwrap();
    let opts = ContextOptions::from_env().unwrap().kernel_family(KernelFamily::CpuDriver);
    let ctx = Context::new_with(&opts).unwrap();
    eprintln!("{}", ctx.report().name);
    // (b, lq, lk, h, hkv, dk, dv, causal, softcap)
    let cases = [(2, 70, 137, 4, 2, 40, 24, true, false), (1, 129, 129, 2, 2, 64, 64, false, false),
        (2, 33, 77, 2, 1, 64, 64, true, true), (1, 200, 130, 2, 2, 36, 20, false, false)];
    for (i, &(b, lq, lk, h, hkv, dk, dv, causal, softcap)) in cases.iter().enumerate() {
        let up = |d: Vec<f32>, s: [usize; 4]| GpuTensor::from_slice(&ctx, &d, &s).unwrap().heads().unwrap();
        let q = up(data(b * lq * h * dk, 1 + i as u32), [b, lq, h, dk]);
        let k = up(data(b * lk * hkv * dk, 2 + i as u32), [b, lk, hkv, dk]);
        let v = up(data(b * lk * hkv * dv, 3 + i as u32), [b, lk, hkv, dv]);
        let d_out = up(data(b * lq * h * dv, 4 + i as u32), [b, lq, h, dv]);
        let mut o = AttentionOptions::new().causal(causal);
        if softcap { o = o.softcap(5.0); }
        let fwd = attention_forward(&ctx, &q, &k, &v, &o).unwrap();
        let g = attention_backward(&ctx, &q, &k, &v, &fwd, &d_out, &o).unwrap();
        for t in [&g.dq, &g.dk, &g.dv] {
            for x in t.to_vec(&ctx).unwrap() { writeln!(f, "{:08x}", x.to_bits()).unwrap(); }
        }
    }
}
