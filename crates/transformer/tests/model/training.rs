//! Training step and checkpoints: a few steps on a fixed batch lower the loss; a checkpoint restores
//! weights, moments and step count exactly (the next step is bitwise the same as without the round
//! trip); periodic saves resume bitwise; a checkpoint of another configuration, with a tensor
//! missing, truncated or corrupted is refused with nothing written; a failed save leaves the previous
//! checkpoint loadable; unwritable paths fail up front; a non-finite step stops every update and
//! every save; steps allocate no tensor and create no bind group after the first; a step is one
//! compute pass and one submission, bitwise equal to the same step in a pass per kernel; mixed
//! precision trains, skips overflowing steps and resumes bitwise with its loss scale.

use crate::common;

use common::{for_each_backend, fresh_context};
use std::collections::HashMap;
use wgpu_attention::kernels::loss_scale::LossScaling;
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention_transformer::layers::Precision;
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};

use wgpu_attention::{Context, Error};
use wgpu_attention_transformer::model::transformer::{Activation, Norm, RopeScaling};
use wgpu_attention_transformer::training::checkpoint::{self, Checkpointer};
use wgpu_attention_transformer::training::Trainer;

fn config(d_ff: usize) -> TransformerConfig {
    TransformerConfig::default()
        .vocab(9)
        .d_model(16)
        .heads(2)
        .d_ff(d_ff)
        .encoder_layers(1)
        .decoder_layers(1)
        .pre_ln(true)
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
    let adam = AdamWConfig::default().lr(1e-2);
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
fn a_step_is_one_pass_and_equals_a_pass_per_kernel_bitwise() {
    for_each_backend(|backend, ctx| {
        let b = batch();
        let mut one = trainer(ctx, 32);
        one.step(ctx, &b).unwrap();
        let before = ctx.recorded_counts();
        one.step(ctx, &b).unwrap();
        let after = ctx.recorded_counts();
        assert_eq!(
            (
                after.passes - before.passes,
                after.submissions - before.submissions
            ),
            (1, 1),
            "[{backend}] passes and submissions of a training step"
        );
        // The same steps with a pass per kernel, on a context of the same adapter.
        let mut separate = fresh_context(backend, ctx);
        separate.set_pass_per_kernel(true);
        let mut split = trainer(&separate, 32);
        split.step(&separate, &b).unwrap();
        let before = separate.recorded_counts();
        split.step(&separate, &b).unwrap();
        let passes = separate.recorded_counts().passes - before.passes;
        assert!(passes > 20, "[{backend}] {passes} passes per kernel");
        let bits = |ctx: &Context, t: &Trainer| -> Vec<Vec<u32>> {
            t.model
                .params
                .values()
                .iter()
                .chain([t.model.loss()])
                .map(|x| x.to_vec(ctx).unwrap().iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        assert!(
            bits(ctx, &one) == bits(&separate, &split),
            "[{backend}] one pass and a pass per kernel differ"
        );
    });
}

/// The model-zoo blocks in a checkpoint: grouped key/value heads, RMSNorm, SwiGLU, no biases, tied
/// embeddings and scaled rotary frequencies, in an encoder-decoder.
fn llama_blocks() -> TransformerConfig {
    config(32)
        .kv_heads(Some(1))
        .norm(Norm::RmsNorm)
        .activation(Activation::Silu)
        .gated_feed_forward(true)
        .bias(false)
        .output_bias(false)
        .tied_embeddings(true)
        .rope_base(Some(500.0))
        .rope_scaling(Some(RopeScaling::Linear { factor: 2.0 }))
}

#[test]
fn checkpoint_round_trip_resumes_exactly() {
    for_each_backend(|backend, ctx| {
        for (name, c) in [("default", config(32)), ("llama blocks", llama_blocks())] {
            let b = batch();
            let path = temp(&format!("{backend}-resume.safetensors"));
            let adam = AdamWConfig::default().lr(1e-2);
            let mut a =
                Trainer::new(ctx, Transformer::new(ctx, c, SHAPE, 3).unwrap(), adam).unwrap();
            for _ in 0..3 {
                a.step(ctx, &b).unwrap();
            }
            checkpoint::save(ctx, &a, &path).unwrap();
            a.step(ctx, &b).unwrap();

            // A fresh trainer (other initial weights) resumed from the checkpoint takes the same step.
            let model = Transformer::new(ctx, c, SHAPE, 99).unwrap();
            let mut r = Trainer::new(ctx, model, *a.optimizer.config()).unwrap();
            checkpoint::load(ctx, &mut r, &path).unwrap();
            assert_eq!(r.optimizer.steps(), 3, "[{backend}] {name}: step count");
            r.step(ctx, &b).unwrap();
            assert_eq!(
                values(ctx, &a),
                values(ctx, &r),
                "[{backend}] {name}: resumed step differs"
            );
            std::fs::remove_file(&path).ok();
        }
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
            text.contains("d_ff (checkpoint 24, this model 32)"),
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
            meta.insert("config".into(), serde_json::to_string(&config(32)).unwrap());
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

/// A different batch for every step (ids 3..=8 of vocab 9), a function of the step only.
fn batch_at(step: u32) -> Batch {
    let mut b = batch();
    let shift = |t: &mut u32| {
        if *t >= 3 {
            *t = 3 + (*t - 3 + step) % 6;
        }
    };
    b.src.iter_mut().for_each(shift);
    b.tgt_in.iter_mut().for_each(shift);
    b.tgt_out.iter_mut().for_each(shift);
    b
}

fn bits(values: Vec<Vec<f32>>) -> Vec<Vec<u32>> {
    values
        .into_iter()
        .map(|v| v.into_iter().map(f32::to_bits).collect())
        .collect()
}

#[test]
fn periodic_saves_resume_bitwise() {
    for_each_backend(|backend, ctx| {
        let path = temp(&format!("{backend}-periodic/run.safetensors"));
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
        let saver = Checkpointer::new(&path, 2).unwrap();
        assert!(path.parent().unwrap().is_dir(), "the directory is created");

        // Uninterrupted: 5 steps.
        let mut whole = trainer(ctx, 32);
        for step in 0..5 {
            whole.step(ctx, &batch_at(step)).unwrap();
        }

        // Interrupted after 3 steps (last save at 2), resumed by a fresh trainer up to 5.
        let mut first = trainer(ctx, 32);
        assert_eq!(saver.resume(ctx, &mut first).unwrap(), None);
        let mut saved = Vec::new();
        for step in 0..3 {
            first.step(ctx, &batch_at(step)).unwrap();
            saved.push(saver.save_if_due(ctx, &first).unwrap());
        }
        assert_eq!(
            saved,
            [false, true, false],
            "[{backend}] saves every 2 steps"
        );
        drop(first);
        let model = Transformer::new(ctx, config(32), SHAPE, 77).unwrap();
        let mut resumed = Trainer::new(ctx, model, *whole.optimizer.config()).unwrap();
        assert_eq!(saver.resume(ctx, &mut resumed).unwrap(), Some(2));
        for step in 2..5 {
            resumed.step(ctx, &batch_at(step)).unwrap();
        }
        assert_eq!(
            bits(values(ctx, &whole)),
            bits(values(ctx, &resumed)),
            "[{backend}] resumed run differs from the uninterrupted one"
        );
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
    });
}

#[test]
fn failed_or_torn_saves_leave_the_previous_checkpoint() {
    for_each_backend(|backend, ctx| {
        let dir = temp(&format!("{backend}-faults"));
        std::fs::remove_dir_all(&dir).ok();
        let path = dir.join("model.safetensors");
        let mut t = trainer(ctx, 32);
        t.step(ctx, &batch()).unwrap();
        checkpoint::save(ctx, &t, &path).unwrap();
        let good = values(ctx, &t);
        let good_bytes = std::fs::read(&path).unwrap();
        t.step(ctx, &batch()).unwrap();

        // A write that fails midway: the temporary file cannot be created (a directory stands in
        // its way, which stops root too).
        let tmp = dir.join(format!(".model.safetensors.tmp-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        let err = checkpoint::save(ctx, &t, &path).unwrap_err();
        assert!(
            matches!(err, Error::Checkpoint(_)) && err.to_string().contains("unchanged"),
            "[{backend}] {err}"
        );
        std::fs::remove_dir(&tmp).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            good_bytes,
            "[{backend}] old file touched"
        );

        // A crash after a partial write leaves a torn temporary file: the checkpoint is the old one.
        std::fs::write(&tmp, &good_bytes[..good_bytes.len() / 3]).unwrap();
        let mut r = trainer(ctx, 32);
        checkpoint::load(ctx, &mut r, &path).unwrap();
        assert_eq!(values(ctx, &r), good, "[{backend}] previous checkpoint");
        assert_eq!(r.optimizer.steps(), 1);
        std::fs::remove_file(&tmp).unwrap();

        // What a non-atomic writer would leave: a truncated file, then flipped data bits. Both are
        // refused, and the trainer is untouched.
        let fresh = values(ctx, &trainer(ctx, 32));
        let broken = dir.join("broken.safetensors");
        for (what, bytes, expect) in [
            (
                "truncated",
                good_bytes[..good_bytes.len() - 100].to_vec(),
                "truncated or corrupt",
            ),
            (
                "flipped",
                {
                    let mut b = good_bytes.clone();
                    let at = b.len() - 7;
                    b[at] ^= 0x10;
                    b
                },
                "CRC-32",
            ),
        ] {
            std::fs::write(&broken, bytes).unwrap();
            let mut f = trainer(ctx, 32);
            let err = checkpoint::load(ctx, &mut f, &broken).unwrap_err();
            assert!(
                err.to_string().contains(expect),
                "[{backend}] {what}: {err}"
            );
            assert_eq!(
                values(ctx, &f),
                fresh,
                "[{backend}] {what}: a refused load wrote"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    });
}

#[test]
fn unwritable_checkpoint_paths_fail_before_training() {
    let dir = temp("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    // Under a regular file: no directory can be created there, whoever runs the test.
    let err = Checkpointer::new(file.join("run.safetensors"), 10).unwrap_err();
    assert!(
        matches!(err, Error::Checkpoint(_)) && err.to_string().contains("a-file"),
        "{err}"
    );
    let err = Checkpointer::new(&dir, 10).unwrap_err();
    assert!(err.to_string().contains("is a directory"), "{err}");
    let err = Checkpointer::new(dir.join("ok.safetensors"), 0).unwrap_err();
    assert!(err.to_string().contains("every"), "{err}");
    let ok = Checkpointer::new(dir.join("new/sub/ok.safetensors"), 10).unwrap();
    assert!(ok.path().parent().unwrap().is_dir());
    assert_eq!(
        std::fs::read_dir(ok.path().parent().unwrap())
            .unwrap()
            .count(),
        0,
        "the probe file is removed"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_non_finite_step_stops_updates_and_saves() {
    for_each_backend(|backend, ctx| {
        let path = temp(&format!("{backend}-diverged.safetensors"));
        // A learning rate this large sends the weights to ~1e30 in one step; the next forward
        // overflows, so the loss and the gradient norm of step 2 are NaN.
        let model = Transformer::new(ctx, config(32), SHAPE, 3).unwrap();
        let adam = AdamWConfig::default().lr(1e30);
        let mut t = Trainer::new(ctx, model, adam).unwrap();
        t.step(ctx, &batch()).unwrap();
        t.check_finite(ctx).unwrap();
        checkpoint::save(ctx, &t, &path).unwrap();
        let saved = std::fs::read(&path).unwrap();
        let after_first = bits(values(ctx, &t));
        for _ in 0..3 {
            t.step(ctx, &batch()).unwrap();
        }
        assert!(!t.model.loss().to_vec(ctx).unwrap()[0].is_finite());
        let err = t.check_finite(ctx).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NonFinite {
                    step: 2,
                    last_good: 1,
                    ..
                }
            ),
            "[{backend}] {err}"
        );
        assert!(err.to_string().contains("loss"), "[{backend}] {err}");
        assert_eq!(
            bits(values(ctx, &t)),
            after_first,
            "[{backend}] the optimizer changed state after the non-finite step"
        );
        let refused = checkpoint::save(ctx, &t, &path).unwrap_err();
        assert!(
            matches!(refused, Error::NonFinite { .. }),
            "[{backend}] {refused}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            saved,
            "[{backend}] checkpoint touched"
        );

        // Loading the last good checkpoint clears the latch.
        checkpoint::load(ctx, &mut t, &path).unwrap();
        t.check_finite(ctx).unwrap();
        assert_eq!(bits(values(ctx, &t)), after_first);
        std::fs::remove_file(&path).ok();
    });
}

/// The CRC-32 a version 2 checkpoint holds: of the tensor data only, parameters then the two AdamW
/// moments, each in the model's parameter order.
fn version_2_checksum(path: &std::path::Path, t: &Trainer) -> String {
    checksum(path, t, &[])
}

/// The CRC-32 a version 3 checkpoint holds: its four header fields (each name and value after its
/// length), then the tensor data as version 2's.
fn version_3_checksum(
    path: &std::path::Path,
    t: &Trainer,
    header: &HashMap<String, String>,
) -> String {
    let fields: Vec<(&str, &str)> = ["format", "format_version", "config", "adam_steps"]
        .iter()
        .map(|name| (*name, header[*name].as_str()))
        .collect();
    checksum(path, t, &fields)
}

fn checksum(path: &std::path::Path, t: &Trainer, fields: &[(&str, &str)]) -> String {
    use safetensors::tensor::SafeTensors;
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut crc = crc32fast::Hasher::new();
    for (name, value) in fields {
        for part in [name, value] {
            crc.update(&(part.len() as u64).to_le_bytes());
            crc.update(part.as_bytes());
        }
    }
    for prefix in ["param", "adam_m", "adam_v"] {
        for name in t.model.params.names() {
            crc.update(file.tensor(&format!("{prefix}.{name}")).unwrap().data());
        }
    }
    format!("{:08x}", crc.finalize())
}

/// Rewrites a checkpoint's metadata (the tensors stay as they are).
fn with_metadata(
    from: &std::path::Path,
    to: &std::path::Path,
    edit: impl Fn(&mut HashMap<String, String>),
) {
    use safetensors::tensor::SafeTensors;
    let bytes = std::fs::read(from).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    edit(&mut meta);
    safetensors::serialize_to_file(file.tensors(), Some(meta), to).unwrap();
}

#[test]
fn configurations_are_compared_field_by_field() {
    for_each_backend(|backend, ctx| {
        let path = temp(&format!("{backend}-config.safetensors"));
        let edited = temp(&format!("{backend}-config-edited.safetensors"));
        let mut t = trainer(ctx, 32);
        t.step(ctx, &batch()).unwrap();
        checkpoint::save(ctx, &t, &path).unwrap();
        let expected = values(ctx, &t);
        let json = serde_json::to_value(config(32)).unwrap();

        // A checkpoint from before a field existed (version 2: its checksum covers the tensor
        // data only) loads with the field's default ...
        let data_crc = version_2_checksum(&path, &t);
        with_metadata(&path, &edited, |meta| {
            let mut c = json.clone();
            c.as_object_mut().unwrap().remove("learned_positions");
            meta.insert("config".into(), c.to_string());
            meta.insert("format_version".into(), "2".into());
            meta.insert("crc32".into(), data_crc.clone());
        });
        let mut r = trainer(ctx, 32);
        checkpoint::load(ctx, &mut r, &edited).unwrap();
        assert_eq!(values(ctx, &r), expected, "[{backend}] defaulted field");

        // ... and is refused, naming the field, by a model that set it otherwise.
        let learned = config(32).learned_positions(true);
        let model = Transformer::new(ctx, learned, SHAPE, 3).unwrap();
        let mut other = Trainer::new(ctx, model, AdamWConfig::default()).unwrap();
        let err = checkpoint::load(ctx, &mut other, &edited).unwrap_err();
        assert!(
            err.to_string()
                .contains("learned_positions (checkpoint false, this model true)"),
            "[{backend}] {err}"
        );

        // A field this version does not know (a newer checkpoint) is named too.
        with_metadata(&path, &edited, |meta| {
            let mut c = json.clone();
            c.as_object_mut()
                .unwrap()
                .insert("rotary_base".into(), 10000.into());
            meta.insert("config".into(), c.to_string());
        });
        let err = checkpoint::load(ctx, &mut r, &edited).unwrap_err();
        assert!(err.to_string().contains("rotary_base"), "[{backend}] {err}");

        // Version 1 files (configuration as Debug text, no checksum) still load.
        with_metadata(&path, &edited, |meta| {
            meta.insert(
                "format".into(),
                "wgpu-attention transformer checkpoint v1".into(),
            );
            meta.remove("format_version");
            meta.remove("crc32");
            // Written by version 1, before the score-modifier fields existed: they take their
            // defaults.
            let v1_text = "TransformerConfig { vocab: 9, d_model: 16, heads: 2, d_ff: 32, \
                encoder_layers: 1, decoder_layers: 1, pre_ln: true, learned_positions: false, \
                pad_id: 0 }";
            meta.insert("config".into(), v1_text.into());
        });
        let mut v1 = trainer(ctx, 32);
        checkpoint::load(ctx, &mut v1, &edited).unwrap();
        assert_eq!(values(ctx, &v1), expected, "[{backend}] version 1");

        // Version 3 checksums the header: an edited step count (which would make a resumed run
        // skip steps) or configuration is refused, the trainer untouched.
        let fresh = values(ctx, &trainer(ctx, 32));
        for (field, value) in [("adam_steps", "90"), ("config", "")] {
            with_metadata(&path, &edited, |meta| {
                let value = match field {
                    "config" => {
                        let mut c = json.clone();
                        c.as_object_mut().unwrap().remove("learned_positions");
                        c.to_string()
                    }
                    _ => value.to_string(),
                };
                meta.insert(field.into(), value);
            });
            let mut f = trainer(ctx, 32);
            let err = checkpoint::load(ctx, &mut f, &edited).unwrap_err();
            assert!(
                err.to_string().contains("edited"),
                "[{backend}] {field}: {err}"
            );
            assert_eq!(
                values(ctx, &f),
                fresh,
                "[{backend}] {field}: a refused load wrote"
            );
            assert_eq!(f.optimizer.steps(), 0, "[{backend}] {field}");
        }

        // Version 4 checksums the loss scale too.
        with_metadata(&path, &edited, |meta| {
            let scale =
                r#"{"scale":1024.0,"clean_steps":0,"skipped_steps":0,"last_step_skipped":false}"#;
            meta.insert("loss_scale".into(), scale.into());
        });
        let err = checkpoint::load(ctx, &mut r, &edited).unwrap_err();
        assert!(err.to_string().contains("edited"), "[{backend}] {err}");

        // Version 3 files (no loss scale) still load.
        with_metadata(&path, &edited, |meta| {
            meta.remove("loss_scale");
            meta.insert("format_version".into(), "3".into());
            let crc = version_3_checksum(&path, &t, meta);
            meta.insert("crc32".into(), crc);
        });
        let mut v3 = trainer(ctx, 32);
        checkpoint::load(ctx, &mut v3, &edited).unwrap();
        assert_eq!(values(ctx, &v3), expected, "[{backend}] version 3");

        with_metadata(&path, &edited, |meta| {
            meta.insert("format_version".into(), "5".into());
        });
        let err = checkpoint::load(ctx, &mut r, &edited).unwrap_err();
        assert!(err.to_string().contains("version 5"), "[{backend}] {err}");
        std::fs::remove_file(&path).ok();
        std::fs::remove_file(&edited).ok();
    });
}

fn mixed_trainer(ctx: &Context, seed: u64) -> wgpu_attention::Result<Trainer> {
    let model = Transformer::new(ctx, config(32), SHAPE, seed)?;
    let adam = AdamWConfig::default().lr(1e-2);
    Trainer::with_precision(ctx, model, adam, Precision::Mixed)
}

/// Mixed precision (f16 products, f32 master weights, loss scaling): the first forward's loss is
/// the f32 model's within the f16 products' bound, steps lower the loss without a skip at the
/// default scale, and a checkpoint resumes bitwise, the loss scale's state included. Where the
/// adapter has no f16 (GL), building the trainer is a typed error.
#[test]
fn mixed_precision_trains_and_resumes_bitwise() {
    for_each_backend(|backend, ctx| {
        let mut t = match mixed_trainer(ctx, 3) {
            Err(e) => {
                assert!(matches!(e, Error::MissingFeature { .. }), "[{backend}] {e}");
                return;
            }
            Ok(t) => t,
        };
        let b = batch();
        let mut f32_trainer = trainer(ctx, 32);
        f32_trainer.forward(ctx, &b).unwrap();
        t.forward(ctx, &b).unwrap();
        let loss = |t: &Trainer| t.model.loss().to_vec(ctx).unwrap()[0];
        let (mixed_loss, f32_loss) = (loss(&t), loss(&f32_trainer));
        assert!(
            (mixed_loss - f32_loss).abs() <= f32_loss / 256.0,
            "[{backend}] first loss mixed {mixed_loss}, f32 {f32_loss}"
        );
        let first = mixed_loss;
        t.step(ctx, &b).unwrap();
        let allocated = ctx.memory().current_bytes;
        let (created, _) = t.binding_counts();
        for _ in 0..5 {
            t.step(ctx, &b).unwrap();
        }
        // The weight copies and the loss scale live with the model: later steps allocate nothing
        // and reuse every bind group.
        assert_eq!(
            t.binding_counts().0,
            created,
            "[{backend}] bind groups created"
        );
        assert_eq!(
            ctx.memory().current_bytes,
            allocated,
            "[{backend}] allocated"
        );
        t.check_finite(ctx).unwrap();
        t.forward(ctx, &b).unwrap();
        assert!(
            loss(&t) < first * 0.9,
            "[{backend}] loss {first} -> {}",
            loss(&t)
        );
        let state = t.loss_scale_state(ctx).unwrap().unwrap();
        assert_eq!(
            (state.scale, state.skipped_steps),
            (65536.0, 0),
            "[{backend}]"
        );
        assert_eq!(state.clean_steps, 6, "[{backend}]");

        let path = temp(&format!("{backend}-mixed.safetensors"));
        checkpoint::save(ctx, &t, &path).unwrap();
        t.step(ctx, &b).unwrap();
        let mut r = mixed_trainer(ctx, 99).unwrap();
        checkpoint::load(ctx, &mut r, &path).unwrap();
        assert_eq!(r.loss_scale_state(ctx).unwrap(), Some(state), "[{backend}]");
        r.step(ctx, &b).unwrap();
        assert_eq!(
            bits(values(ctx, &t)),
            bits(values(ctx, &r)),
            "[{backend}] resumed mixed-precision step differs"
        );
        assert_eq!(
            r.loss_scale_state(ctx).unwrap(),
            t.loss_scale_state(ctx).unwrap()
        );
        std::fs::remove_file(&path).ok();
    });
}

/// A loss scale so large that the scaled loss gradient overflows f16 in the output layer's
/// products: each such step is skipped (weights and moments unchanged, nothing latched) and halves
/// the scale until the gradients fit; then training proceeds and lowers the loss.
#[test]
fn mixed_precision_skips_overflowing_steps() {
    for_each_backend(|backend, ctx| {
        let Ok(mut t) = mixed_trainer(ctx, 3) else {
            return;
        };
        let max = LossScaling::MAX_SCALE;
        let scaling = LossScaling::default().initial_scale(max);
        t.optimizer.enable_loss_scaling(ctx, scaling).unwrap();
        let b = batch();
        let before = bits(values(ctx, &t));
        t.step(ctx, &b).unwrap();
        let state = t.loss_scale_state(ctx).unwrap().unwrap();
        assert!(state.last_step_skipped, "[{backend}] {state:?}");
        assert_eq!(
            (state.scale, state.skipped_steps),
            (max / 2.0, 1),
            "[{backend}]"
        );
        assert_eq!(
            bits(values(ctx, &t)),
            before,
            "[{backend}] a skipped step changed state"
        );
        t.check_finite(ctx).unwrap();
        // Halving from 2^24 reaches a scale that fits within a handful of steps.
        let mut skipped = 1;
        while t.loss_scale_state(ctx).unwrap().unwrap().last_step_skipped {
            assert!(
                skipped < 12,
                "[{backend}] still skipping after {skipped} steps"
            );
            t.step(ctx, &b).unwrap();
            skipped += 1;
        }
        let state = t.loss_scale_state(ctx).unwrap().unwrap();
        assert_eq!(state.skipped_steps, skipped - 1, "[{backend}] {state:?}");
        assert_eq!(state.scale, max / 2f32.powi(state.skipped_steps as i32));
        t.forward(ctx, &b).unwrap();
        let first = t.model.loss().to_vec(ctx).unwrap()[0];
        for _ in 0..4 {
            t.step(ctx, &b).unwrap();
        }
        t.check_finite(ctx).unwrap();
        t.forward(ctx, &b).unwrap();
        let last = t.model.loss().to_vec(ctx).unwrap()[0];
        assert!(last < first, "[{backend}] loss {first} -> {last}");
    });
}
