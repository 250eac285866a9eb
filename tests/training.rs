//! Training step and checkpoints: a few steps on a fixed batch lower the loss; a checkpoint restores
//! weights, moments and step count exactly (the next step is bitwise the same as without the round
//! trip); a checkpoint of another configuration or with a tensor missing is refused with nothing
//! written; steps allocate no tensor and create no bind group after the first.

mod common;

use common::for_each_backend;
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention::training::{checkpoint, Trainer};
use wgpu_attention::{Context, Error};

fn config(d_ff: usize) -> TransformerConfig {
    TransformerConfig {
        vocab: 9,
        d_model: 16,
        heads: 2,
        d_ff,
        encoder_layers: 1,
        decoder_layers: 1,
        pre_ln: true,
        learned_positions: false,
        pad_id: 0,
    }
}

const SHAPE: BatchShape = BatchShape {
    batch: 2,
    src_len: 5,
    tgt_len: 4,
};

fn batch() -> Batch {
    Batch {
        src: vec![3, 4, 5, 6, 7, 8, 3, 0, 0, 0],
        src_lens: vec![5, 2],
        tgt_in: vec![1, 7, 6, 5, 1, 3, 0, 0],
        tgt_out: vec![7, 6, 5, 4, 3, 8, 0, 0],
        tgt_lens: vec![4, 2],
    }
}

fn trainer(ctx: &Context, d_ff: usize) -> Trainer {
    let model = Transformer::new(ctx, config(d_ff), SHAPE, 3).unwrap();
    let adam = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    Trainer::new(ctx, model, adam).unwrap()
}

fn values(ctx: &Context, t: &Trainer) -> Vec<Vec<f32>> {
    let (m, v) = t.optimizer.moments();
    t.model
        .params
        .values()
        .iter()
        .chain(m)
        .chain(v)
        .map(|x| x.to_vec(ctx).unwrap())
        .collect()
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("wgpu-attention-{}-{name}", std::process::id()))
}

#[test]
fn steps_lower_the_loss_without_allocating() {
    for_each_backend(|backend, ctx| {
        let mut t = trainer(ctx, 32);
        let b = batch();
        t.step(ctx, &b).unwrap();
        let first = t.model.loss().to_vec(ctx).unwrap()[0];
        let allocated = ctx.memory().current_bytes;
        let (created, _) = t.binding_counts();
        for _ in 0..20 {
            t.step(ctx, &b).unwrap();
        }
        let (created_after, reused) = t.binding_counts();
        assert_eq!(
            created, created_after,
            "[{backend}] later steps created bind groups"
        );
        assert!(
            reused >= 20 * created,
            "[{backend}] {reused} bind groups reused"
        );
        let last = t.model.loss().to_vec(ctx).unwrap()[0];
        assert_eq!(
            ctx.memory().current_bytes,
            allocated,
            "[{backend}] a step allocated tensors"
        );
        assert!(
            last.is_finite() && last < 0.5 * first,
            "[{backend}] loss {first} -> {last}"
        );
        eprintln!("[{backend}] loss {first:.4} -> {last:.4} in 20 steps");
    });
}

#[test]
fn checkpoint_round_trip_resumes_exactly() {
    for_each_backend(|backend, ctx| {
        let b = batch();
        let path = temp(&format!("{backend}-resume.safetensors"));
        let mut a = trainer(ctx, 32);
        for _ in 0..3 {
            a.step(ctx, &b).unwrap();
        }
        checkpoint::save(ctx, &a, &path).unwrap();
        a.step(ctx, &b).unwrap();

        // A fresh trainer (other initial weights) resumed from the checkpoint takes the same step.
        let model = Transformer::new(ctx, config(32), SHAPE, 99).unwrap();
        let mut r = Trainer::new(ctx, model, *a.optimizer.config()).unwrap();
        checkpoint::load(ctx, &mut r, &path).unwrap();
        assert_eq!(r.optimizer.steps(), 3, "[{backend}] step count");
        r.step(ctx, &b).unwrap();
        assert_eq!(
            values(ctx, &a),
            values(ctx, &r),
            "[{backend}] resumed step differs"
        );
        std::fs::remove_file(&path).ok();
    });
}

#[test]
fn mismatched_checkpoints_are_refused_and_write_nothing() {
    for_each_backend(|backend, ctx| {
        let path = temp(&format!("{backend}-other.safetensors"));
        let other = trainer(ctx, 24);
        checkpoint::save(ctx, &other, &path).unwrap();
        let mut t = trainer(ctx, 32);
        let before = values(ctx, &t);
        let err = checkpoint::load(ctx, &mut t, &path).unwrap_err();
        assert!(matches!(err, Error::Checkpoint(_)), "[{backend}] {err}");
        let text = err.to_string();
        assert!(
            text.contains("d_ff: 24") && text.contains("d_ff: 32"),
            "[{backend}] {text}"
        );
        assert_eq!(
            before,
            values(ctx, &t),
            "[{backend}] a refused load wrote tensors"
        );

        // Same configuration, one tensor missing: refused too, nothing written.
        let bytes = std::fs::read(&path).unwrap();
        let cut = temp(&format!("{backend}-cut.safetensors"));
        {
            use safetensors::tensor::SafeTensors;
            let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
            let file = SafeTensors::deserialize(&bytes).unwrap();
            let mut meta = header.metadata().clone().unwrap();
            meta.insert("config".into(), format!("{:?}", config(32)));
            let kept: Vec<_> = file
                .tensors()
                .into_iter()
                .filter(|(n, _)| n != "param.out.bias")
                .collect();
            safetensors::serialize_to_file(kept, Some(meta), &cut).unwrap();
        }
        let err = checkpoint::load(ctx, &mut t, &cut).unwrap_err();
        assert!(
            err.to_string().contains("param.out.bias") || err.to_string().contains("F32"),
            "[{backend}] {err}"
        );
        assert_eq!(
            before,
            values(ctx, &t),
            "[{backend}] a refused load wrote tensors"
        );
        std::fs::remove_file(&path).ok();
        std::fs::remove_file(&cut).ok();

        let missing = checkpoint::load(ctx, &mut t, &temp("does-not-exist")).unwrap_err();
        assert!(missing.to_string().contains("does-not-exist"), "{missing}");
    });
}

#[test]
fn bad_batches_are_rejected_before_anything_is_written() {
    for_each_backend(|_, ctx| {
        let mut t = trainer(ctx, 32);
        let mut b = batch();
        b.tgt_out[1] = 9; // vocab 9
        assert!(t.step(ctx, &b).unwrap_err().to_string().contains("vocab"));
        let mut b = batch();
        b.src_lens[0] = 6; // src_len 5
        assert!(t.step(ctx, &b).unwrap_err().to_string().contains("exceeds"));
        let mut b = batch();
        b.tgt_in.pop();
        assert!(t.step(ctx, &b).unwrap_err().to_string().contains("tgt_in"));
        assert_eq!(t.optimizer.steps(), 0);
    });
}
