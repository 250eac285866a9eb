//! The fused forward (`shaders/additive/forward.wgsl`) and incremental decoding
//! (`shaders/additive/decode.wgsl`).

use crate::device::Context;
use crate::error::Result;
use crate::kernels::arguments::check_f32;
use crate::kernels::attention::binding::{
    base_params, bind_tensor, bind_view, encode_chunks, seq_lens_buffer, set_grid, Bound, Kernel,
    Shared, FLAG_ALIGN_LENS, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use crate::kernels::attention::call::AttentionOutput;
use crate::kernels::attention::decode::check_decode_lens;
use crate::kernels::attention::forward::check_forward_outputs;
use crate::kernels::attention::shape::refuse_packed;
use crate::kernels::attention::{AttentionOptions, ForwardViews};
use crate::kernels::dispatch::loop_chunks;
use crate::tensor::HeadsView;

use super::call::{check, AdditiveScores};
use super::sources::{constants, sized, with_shared, DECODE, FORWARD};
use super::tiles::{forward_tile, staged_tile, AdditiveKernel, WG};
use super::tune::{runs_unfused, Tuned};
use super::unfused::{encode_forward_unfused, scratch_tensor};
use crate::device::KernelChoice;
use crate::kernels::attention::unfused::{scores_shape, UnfusedCall};

/// Additive attention forward into new tensors, submitted: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]`.
pub fn additive_forward(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let (s, _) = check(ctx, a, b, v, scores, opts)?;
    AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
        additive_forward_into(
            ctx,
            encoder,
            &ForwardViews {
                q: a,
                k: b,
                v,
                out,
                lse,
            },
            scores,
            opts,
        )
    })
}

/// Records the additive attention forward: `views` with the query and key projections `a [B, Lq,
/// H, Da]` and `b [B, Lk, H, Da]` as `q` and `k`, writing `out` (a `[B, Lq, H, Dv]` view) and
/// `lse`. Nothing is recorded if the input is rejected.
pub fn additive_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    encode_forward(ctx, encoder, views, scores, opts, (false, None))
}

/// [`additive_forward_into`] running `choice` (the tuner's candidates) instead of the context's.
pub(super) fn record_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    choice: KernelChoice,
) -> Result<()> {
    encode_forward(ctx, encoder, views, scores, opts, (false, Some(choice)))
}

/// Additive attention for incremental decoding: new query rows `a [B, L, H, Da]` (`q_lens` per
/// sequence) against caches `b [B, capacity, H, Da]` and `v [B, capacity, H, Dv]` holding `kv_lens`
/// keys each, the new ones last. Masks align on each sequence's own lengths, as in
/// [`attention_decode_into`](crate::kernels::attention::attention_decode_into): query `i` of sequence `s` sits at position
/// `kv_lens[s] - q_lens[s] + i`. Up to 16 rows per sequence, one workgroup per row, its
/// invocations splitting the cached keys (`shaders/additive/decode.wgsl`); more (a prefill chunk),
/// the forward kernel. Results match [`additive_forward_into`] on the whole sequence.
pub fn additive_decode_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let [batch, rows, _, _] = views.q.shape();
    let capacity = views.k.shape()[1];
    check_decode_lens("additive decoding", [batch, rows, capacity], opts)?;
    encode_forward(ctx, encoder, views, scores, opts, (true, None))
}

/// Records the forward: the fused kernels, or the unfused path where `choice` (the context's,
/// tuned, where `None`) says so; `aligned`: masks align on each sequence's lengths (decoding,
/// always fused).
fn encode_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    (aligned, choice): (bool, Option<KernelChoice>),
) -> Result<()> {
    let &ForwardViews {
        q: a,
        k: b,
        v,
        out,
        lse,
    } = views;
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    check_f32(&[("out", out)])?;
    let inputs = [
        ("a", a.region()),
        ("b", b.region()),
        ("v", v.region()),
        ("w", scores.w.region()),
        ("bias", scores.bias.region()),
    ];
    refuse_packed(&[("out", out)], "additive attention")?;
    check_forward_outputs(ctx, &s, out, lse, &inputs, opts)?;
    // A whole-sequence call takes the unfused path where the context's tuning found it faster
    // (aligned calls, decoding's, run the fused kernels: the unfused ones do not align lengths).
    if !aligned && runs_unfused(ctx, Tuned::Forward, &s, opts, choice)? {
        let probs = scratch_tensor(ctx, "additive unfused probs", &scores_shape(ctx, &s)?)?;
        let mut pass = ctx.begin_pass(encoder, "additive_forward_unfused");
        let call = UnfusedCall::new(ctx, &s, scale, opts);
        let views = [a, b, v];
        return encode_forward_unfused(ctx, &mut pass, call, views, scores, &probs, (out, lse));
    }
    let mut params = base_params(&s, scale, opts);
    if aligned {
        params.flags |= FLAG_ALIGN_LENS;
    }
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    // Decoding a few rows per sequence (at most a quarter of a workgroup: a step's new tokens, not
    // a prefill chunk): one workgroup per query row, its invocations splitting the keys, where the
    // forward's 64-row workgroups would sit mostly idle; otherwise WG rows per workgroup.
    let decoding = aligned && s.q_seq * 4 <= WG as usize;
    let (tile, own_in_workgroup) = match decoding {
        true => (staged_tile(ctx, &s, 1), false),
        false => forward_tile(ctx, &s),
    };
    let (kernel, name, source, blocks, align) = match decoding {
        true => (
            AdditiveKernel::Decode,
            "additive_decode",
            DECODE,
            s.q_seq,
            WG,
        ),
        false => {
            let blocks = s.q_seq.div_ceil(WG as usize);
            let kernel = AdditiveKernel::Forward;
            (kernel, "additive_forward", FORWARD, blocks, tile)
        }
    };
    let mut constants = constants(&s, tile).to_vec();
    if !decoding {
        constants.push(("OWN_IN_WORKGROUP", own_in_workgroup as u32));
    }
    let grid = set_grid(ctx, &mut params, blocks, s.batch * s.heads)?;
    let (per_key, fixed) = kernel.loop_cost(s.head_dim_qk, s.head_dim_v, tile, 1);
    let chunks = loop_chunks(ctx, s.kv_seq, per_key, fixed, align as usize);
    let mut pass = ctx.begin_pass(encoder, name);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name,
            source: |score_bias| {
                let own = [("MAX_OWN", s.head_dim_v.div_ceil(WG as usize) as u32)];
                let sizes: &[(&str, u32)] = match decoding {
                    true => &own,
                    false => &[],
                };
                sized(&with_shared(source), &s, sizes, score_bias)
            },
            constants: &constants,
        },
        &mut params,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}
