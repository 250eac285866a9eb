//! `--compile-only`: every fused-path pipeline of the run, built and not run.

use wgpu_attention::{AttentionShape, BiasView, Context, GpuTensor, KernelFamily};

use crate::cli::{Cli, Pass, PathKind, Suite};
use crate::problem::{OptionTensors, Problem, RELATIVE_BUCKETS};

use wgpu_attention::{attention_precompile, AttentionPasses};

/// Builds the pipelines of every (problem, kernel family, pass) of the run. The options carry
/// placeholder tensors of the right shapes (a zero-stride bias view, small tables): pipelines do
/// not depend on their values, so no `Lq x Lk` bias is allocated.
pub(crate) fn compile_only(
    cli: &Cli,
    ctx: &mut Context,
    problems: &[Problem],
) -> wgpu_attention::Result<bool> {
    println!("adapter: {}", ctx.report());
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    let passes = match cli.passes.as_deref() {
        Some(p) if !p.contains(&Pass::Backward) => AttentionPasses::Forward,
        _ => AttentionPasses::ForwardBackward,
    };
    let families: Vec<KernelFamily> = match (&cli.kernels, suite) {
        (Some(k), _) => k.iter().map(|k| k.family()).collect(),
        (None, Suite::Gpu) => vec![KernelFamily::CpuDriver, KernelFamily::Gpu],
        (None, _) => vec![ctx.kernel_family()],
    };
    let started = std::time::Instant::now();
    let mut built = 0;
    for p in problems {
        for (_, family) in p.runs(&[PathKind::Fused], &families, false) {
            ctx.set_kernel_family(family);
            let case = format!("{} {}", p.label(), family.map_or("", |f| f.name()));
            // A combination the library refuses (f16 with sinks, say) is refused here as in a
            // timed run, which reports it per case and goes on.
            match compile_problem(ctx, p, passes) {
                Ok(new) => {
                    println!("{case}: {new} new pipelines");
                    built += new;
                }
                Err(e) => println!("{case}: not built: {e}"),
            }
        }
    }
    ctx.set_kernel_family(None);
    println!(
        "built {built} pipelines in {:.1} s ({} cached in all)",
        started.elapsed().as_secs_f64(),
        ctx.cached_pipelines()
    );
    // Building the tensor-core family qualifies it on the device: say how that went.
    for q in ctx.qualifications() {
        println!("qualification: {} {}", q.kernel, q.detail);
    }
    Ok(true)
}

fn compile_problem(
    ctx: &Context,
    p: &Problem,
    passes: AttentionPasses,
) -> wgpu_attention::Result<usize> {
    let h = p.heads;
    let shape = AttentionShape {
        batch: p.batch,
        q_seq: p.q_len,
        kv_seq: p.kv_len,
        heads: h,
        kv_heads: p.kv_heads,
        head_dim_qk: p.dk,
        head_dim_v: p.dv,
    };
    let seq_lens = p.seq_lens(ctx)?;
    let one = GpuTensor::zeros(ctx, &[1])?;
    let bias = BiasView::new(one.buffer().clone(), 0, [1, h, p.q_len, p.kv_len], [0; 4])?;
    let table = GpuTensor::zeros(ctx, &[h, RELATIVE_BUCKETS])?;
    let table_grad = GpuTensor::zeros(ctx, &[h, RELATIVE_BUCKETS])?;
    let sinks = GpuTensor::zeros(ctx, &[h])?;
    let opts = p.options(OptionTensors {
        seq_lens: seq_lens.as_ref(),
        bias: Some(&bias),
        relative: Some((&table, &table_grad)),
        sinks: Some(&sinks),
    });
    attention_precompile(ctx, &shape, p.dtype, &opts, passes)
}
