// First-call (compile) time of the CPU-driver fused backward per head dim: first call minus second.
use std::time::Instant;
use wgpu_attention::*;

fn main() {
    let opts = ContextOptions::from_env().unwrap().kernel_family(KernelFamily::CpuDriver);
    let ctx = Context::new_with(&opts).unwrap();
    for d in [16usize, 40, 64, 128] {
        let (b, l, h) = (1, 16, 1);
        let up = |s: [usize; 4]| GpuTensor::from_slice(&ctx, &vec![0.1f32; s.iter().product()], &s).unwrap().heads().unwrap();
        let q = up([b, l, h, d]);
        let k = up([b, l, h, d]);
        let v = up([b, l, h, d]);
        let d_out = up([b, l, h, d]);
        let o = AttentionOptions::new();
        let fwd = attention_forward(&ctx, &q, &k, &v, &o).unwrap();
        let _ = fwd.out.to_vec(&ctx).unwrap();
        let mut t = Vec::new();
        for _ in 0..2 {
            let s = Instant::now();
            let g = attention_backward(&ctx, &q, &k, &v, &fwd, &d_out, &o).unwrap();
            let _ = g.dq.to_vec(&ctx).unwrap();
            t.push(s.elapsed().as_secs_f64());
        }
        println!("D{d} compile {:.2} s", t[0] - t[1]);
    }
}
