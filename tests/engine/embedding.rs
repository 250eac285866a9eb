//! Token embedding (gather forward, deterministic scatter-add backward) and positional encodings
//! (sinusoidal table, learned table and its gradient) on the GPU vs the f64 reference; errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::embedding::{
    embedding_backward, embedding_forward, positional_backward, positional_forward,
    sinusoidal_table,
};
use wgpu_attention::reference::embedding as reference;
use wgpu_attention::{Context, Error, GpuTensor, GpuTokens};

fn check_embedding(backend: &str, ctx: &Context, shape: &[usize], vocab: usize, dim: usize) {
    let n: usize = shape.iter().product();
    // Repeated ids (i * 7 mod vocab) so the scatter-add really sums several rows per id.
    let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + i / 3) % vocab) as u32).collect();
    let mut rng = rng((n * 100 + vocab) as u64);
    let table = random(&mut rng, vocab * dim, 1.0);
    let dy = random(&mut rng, n * dim, 1.0);
    let tokens = GpuTokens::from_slice(ctx, &ids, shape).unwrap();
    let tt = GpuTensor::from_slice(ctx, &table, &[vocab, dim]).unwrap();
    let mut out_shape = shape.to_vec();
    out_shape.push(dim);
    let dyt = GpuTensor::from_slice(ctx, &dy, &out_shape).unwrap();
    let out = embedding_forward(ctx, &tokens, &tt).unwrap();
    assert_eq!(out.shape(), &out_shape[..]);
    let d_table = embedding_backward(ctx, &tokens, &dyt, vocab).unwrap();
    let tag = format!("[{backend}] embedding {shape:?} vocab {vocab} dim {dim}");
    assert_close(
        &format!("{tag} out"),
        &out.to_vec(ctx).unwrap(),
        &reference::embedding_forward(&ids, &to_f64(&table), dim),
        // A gather: exact copies.
        1e-30,
        0.0,
    );
    assert_close(
        &format!("{tag} d_table"),
        &d_table.to_vec(ctx).unwrap(),
        &reference::embedding_backward(&ids, &to_f64(&dy), vocab, dim),
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
}

#[test]
fn embedding_matches_reference() {
    for_each_backend(|backend, ctx| {
        check_embedding(backend, ctx, &[1], 1, 1);
        check_embedding(backend, ctx, &[3, 17], 11, 5);
        check_embedding(backend, ctx, &[8, 33], 40, 64);
    });
}

#[test]
fn embedding_backward_splits_long_token_ranges() {
    for_each_backend_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        check_embedding(backend, ctx, &[4, 700], 13, 3);
    });
}

#[test]
fn sinusoidal_table_known_values() {
    let t = sinusoidal_table(3, 4);
    // Position 0: sin(0) = 0 on even columns, cos(0) = 1 on odd ones.
    assert_eq!(&t[..4], &[0.0, 1.0, 0.0, 1.0]);
    // Position 1, column pair 0: angle 1; pair 1: angle 1 / 10000^(2/4) = 0.01.
    assert_eq!(t[4], 1f64.sin() as f32);
    assert_eq!(t[5], 1f64.cos() as f32);
    assert_eq!(t[6], 0.01f64.sin() as f32);
    assert_eq!(t[7], 0.01f64.cos() as f32);
}

#[test]
fn positional_encodings_match_reference() {
    for_each_backend(|backend, ctx| {
        let (batch, seq, dim, max_len) = (3, 13, 8, 20);
        let mut rng = rng(9);
        let x = random(&mut rng, batch * seq * dim, 1.0);
        let dy = random(&mut rng, batch * seq * dim, 1.0);
        let xt = GpuTensor::from_slice(ctx, &x, &[batch, seq, dim]).unwrap();
        let dyt = GpuTensor::from_slice(ctx, &dy, &[batch, seq, dim]).unwrap();
        for (name, table) in [
            ("sinusoidal", sinusoidal_table(max_len, dim)),
            ("learned", random(&mut rng, max_len * dim, 0.1)),
        ] {
            let tt = GpuTensor::from_slice(ctx, &table, &[max_len, dim]).unwrap();
            let y = positional_forward(ctx, &xt, &tt).unwrap();
            assert_close(
                &format!("[{backend}] positional {name} y"),
                &y.to_vec(ctx).unwrap(),
                &reference::positional_forward(&to_f64(&x), &to_f64(&table), seq, dim),
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }
        let d_table = positional_backward(ctx, &dyt, max_len).unwrap();
        assert_close(
            &format!("[{backend}] positional d_table"),
            &d_table.to_vec(ctx).unwrap(),
            &reference::positional_backward(&to_f64(&dy), seq, dim, max_len),
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    });
}

/// A packed batch (`SeqLens::packed`, `x [1, rows, dim]`): each sequence from position 0 at its first
/// row (empty sequences included), rows after them unchanged; the table gradient gathers each
/// sequence's rows. Packed new rows after a cache (a packed prefill) start at each sequence's
/// cached length.
#[test]
fn packed_positions_match_reference() {
    use wgpu_attention::kernels::embedding::{
        positional_backward_packed_into, positional_forward_cached_into,
        positional_forward_packed_into,
    };
    use wgpu_attention::SeqLens;
    for_each_backend(|backend, ctx| {
        let (lens, rows, dim, max_len) = ([5u32, 0, 7, 1, 0], 16, 8, 9);
        let packed = SeqLens::packed(ctx, &lens, &lens).unwrap();
        let mut rng = rng(4);
        let x = random(&mut rng, rows * dim, 1.0);
        let dy = random(&mut rng, rows * dim, 1.0);
        let table = random(&mut rng, max_len * dim, 0.1);
        let xt = GpuTensor::from_slice(ctx, &x, &[1, rows, dim]).unwrap();
        let dyt = GpuTensor::from_slice(ctx, &dy, &[1, rows, dim]).unwrap();
        let tt = GpuTensor::from_slice(ctx, &table, &[max_len, dim]).unwrap();
        let y = GpuTensor::zeros(ctx, &[1, rows, dim]).unwrap();
        let d_table = GpuTensor::zeros(ctx, &[max_len, dim]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        positional_forward_packed_into(ctx, &mut encoder, &xt, &tt, &y, &packed).unwrap();
        positional_backward_packed_into(ctx, &mut encoder, &dyt, &d_table, &packed).unwrap();
        ctx.queue().submit([encoder.finish()]);
        assert_close(
            &format!("[{backend}] packed positions y"),
            &y.to_vec(ctx).unwrap(),
            &reference::positional_forward_packed(&to_f64(&x), &to_f64(&table), &lens, dim),
            FORWARD_ATOL,
            FORWARD_RTOL,
        );
        assert_close(
            &format!("[{backend}] packed positions d_table"),
            &d_table.to_vec(ctx).unwrap(),
            &reference::positional_backward_packed(&to_f64(&dy), &lens, dim, max_len),
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        // Sequences past the table, or more rows than the tensor holds, are refused.
        let long = SeqLens::packed(ctx, &[10], &[10]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = positional_forward_packed_into(ctx, &mut encoder, &xt, &tt, &y, &long)
            .unwrap_err()
            .to_string();
        assert!(m.contains("beyond the table's 9 positions"), "{m}");
        let many = SeqLens::packed(ctx, &[9, 9], &[9, 9]).unwrap();
        let m = positional_forward_packed_into(ctx, &mut encoder, &xt, &tt, &y, &many)
            .unwrap_err()
            .to_string();
        assert!(m.contains("lengths' 18"), "{m}");

        // A packed prefill after a cache: each sequence's new rows after its cached tokens.
        let (new, total) = ([5u32, 0, 7, 1, 0], [6u32, 3, 9, 1, 0]);
        let after = SeqLens::packed(ctx, &new, &total).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        positional_forward_cached_into(ctx, &mut encoder, &xt, &tt, &y, &after).unwrap();
        ctx.queue().submit([encoder.finish()]);
        assert_close(
            &format!("[{backend}] packed positions after a cache y"),
            &y.to_vec(ctx).unwrap(),
            &reference::positional_forward_cached_packed(
                &to_f64(&x),
                &to_f64(&table),
                dim,
                &new,
                &total,
            ),
            FORWARD_ATOL,
            FORWARD_RTOL,
        );
        // Cached past the table is refused.
        let past = SeqLens::packed(ctx, &[2], &[10]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = positional_forward_cached_into(ctx, &mut encoder, &xt, &tt, &y, &past)
            .unwrap_err()
            .to_string();
        assert!(m.contains("beyond the capacity 9"), "{m}");
    });
}

#[test]
fn bad_ids_and_lengths_are_typed_errors() {
    for_each_backend(|_, ctx| {
        let table = GpuTensor::zeros(ctx, &[5, 4]).unwrap();
        let tokens = GpuTokens::from_slice(ctx, &[0, 5, 1], &[3]).unwrap();
        assert!(matches!(
            embedding_forward(ctx, &tokens, &table),
            Err(Error::Shape { arg: "tokens", .. })
        ));
        let x = GpuTensor::zeros(ctx, &[2, 6, 4]).unwrap();
        assert!(matches!(
            positional_forward(ctx, &x, &table),
            Err(Error::Shape { arg: "x", .. })
        ));
    });
}
