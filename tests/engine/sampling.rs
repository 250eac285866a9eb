//! GPU token sampling against the f64 reference on every back end: greedy picks the arg max (lowest
//! id among ties); temperature, top-k and top-p draws follow the reference distribution (a
//! chi-square bound over 10240 draws, which the unrestricted distribution fails by far) and agree
//! with the reference's own draws from the same random numbers; ids outside top-k / top-p never
//! appear; bad options are typed errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::sampling::{sample, Sampling};
use wgpu_attention::reference::sampling as reference;
use wgpu_attention::GpuTensor;

/// Chi-square statistic of `counts` against `p` (categories with p > 0).
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .filter(|(_, &q)| q > 0.0)
        .map(|(&c, &q)| {
            let e = q * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn greedy_picks_the_arg_max() {
    for_each_backend(|name, ctx| {
        let (b, v) = (5, 1000);
        let mut logits = random(&mut rng(11), b * v, 4.0);
        // Row 2: a tie for the maximum at ids 700 and 300: the lower id wins.
        logits[2 * v + 700] = 9.0;
        logits[2 * v + 300] = 9.0;
        let t = GpuTensor::from_slice(ctx, &logits, &[b, v]).unwrap();
        for s in [Sampling::greedy(), Sampling::temperature(1.0, 3).top_k(1)] {
            let ids = sample(ctx, &t, &s, 0).unwrap();
            for (row, &id) in ids.iter().enumerate() {
                let expected =
                    reference::sample(&to_f64(&logits[row * v..][..v]), &s, 0, row as u32);
                assert_eq!(id, expected, "[{name}] {s:?} row {row}");
            }
            assert_eq!(ids[2], 300, "[{name}] tie");
        }
    });
}

#[test]
fn draws_follow_the_reference_distribution() {
    // Twelve ids, every row the same logits: 512 rows x 20 draws = 10240 samples per case.
    let logits: Vec<f32> = vec![
        2.0, 1.5, 1.4, 0.9, 0.5, 0.4, 0.0, -0.3, -0.8, -1.0, -2.0, -4.0,
    ];
    let (rows, draws, v) = (512, 20, logits.len());
    let l64 = to_f64(&logits);
    let cases = [
        Sampling::temperature(0.7, 1),
        Sampling::temperature(1.0, 2).top_k(4),
        Sampling::temperature(1.3, 3).top_p(0.8),
        Sampling::temperature(1.0, 4).top_k(6).top_p(0.9),
    ];
    for_each_backend(|name, ctx| {
        let data: Vec<f32> = (0..rows).flat_map(|_| logits.iter().copied()).collect();
        let t = GpuTensor::from_slice(ctx, &data, &[rows, v]).unwrap();
        for s in &cases {
            let p = reference::sampling_distribution(&l64, s);
            let mut counts = vec![0usize; v];
            let mut agree = 0;
            for draw in 0..draws {
                let ids = sample(ctx, &t, s, draw).unwrap();
                for (row, &id) in ids.iter().enumerate() {
                    counts[id as usize] += 1;
                    agree += (id == reference::sample(&l64, s, draw, row as u32)) as usize;
                }
            }
            let n = rows * draws as usize;
            for (id, (&c, &q)) in counts.iter().zip(&p).enumerate() {
                assert!(
                    q > 0.0 || c == 0,
                    "[{name}] {s:?}: id {id} is outside the kept set but was drawn {c} times"
                );
            }
            // 11 degrees of freedom at most: P(chi2 > 50) < 1e-6 for a correct sampler.
            let chi2 = chi_square(&counts, &p);
            assert!(
                chi2 < 50.0,
                "[{name}] {s:?}: chi2 {chi2:.1}, counts {counts:?}, p {p:?}"
            );
            // The same counts against the unrestricted softmax at temperature 1 fail by far: the bound
            // has power.
            let plain = reference::sampling_distribution(&l64, &Sampling::temperature(1.0, 0));
            let wrong = chi_square(&counts, &plain);
            assert!(
                wrong > 200.0,
                "[{name}] {s:?}: chi2 against the plain softmax only {wrong:.1}"
            );
            // The same random numbers: f32 against f64 only differ where a draw lands within
            // rounding of a boundary.
            assert!(
                agree * 1000 >= n * 998,
                "[{name}] {s:?}: {agree} of {n} draws agree with the reference"
            );
            eprintln!("[{name}] {s:?}: chi2 {chi2:.2} (plain {wrong:.0}), {agree}/{n} agree");
        }
    });
}

#[test]
fn long_rows_sample_as_the_reference() {
    // More ids than invocations: strided reductions and several ids per prefix chunk.
    let (b, v) = (6, 5003);
    let logits = random(&mut rng(12), b * v, 6.0);
    for_each_backend(|name, ctx| {
        let t = GpuTensor::from_slice(ctx, &logits, &[b, v]).unwrap();
        let s = Sampling::temperature(0.8, 9).top_k(50).top_p(0.95);
        let mut agree = 0;
        for draw in 0..8 {
            let ids = sample(ctx, &t, &s, draw).unwrap();
            for (row, &id) in ids.iter().enumerate() {
                let l = to_f64(&logits[row * v..][..v]);
                assert!(
                    reference::sampling_distribution(&l, &s)[id as usize] > 0.0,
                    "[{name}] row {row}: id {id} outside top-k/top-p"
                );
                agree += (id == reference::sample(&l, &s, draw, row as u32)) as usize;
            }
        }
        assert!(
            agree >= 47,
            "[{name}] {agree} of 48 draws agree with the reference"
        );
    });
}

#[test]
fn bad_sampling_options_are_typed_errors() {
    for_each_backend(|name, ctx| {
        let t = GpuTensor::zeros(ctx, &[2, 10]).unwrap();
        for (s, needle) in [
            (Sampling::temperature(-1.0, 0), "temperature"),
            (Sampling::temperature(f32::NAN, 0), "temperature"),
            (Sampling::temperature(1.0, 0).top_k(0), "top_k"),
            (Sampling::temperature(1.0, 0).top_p(0.0), "top_p"),
            (Sampling::temperature(1.0, 0).top_p(1.5), "top_p"),
        ] {
            let e = sample(ctx, &t, &s, 0).unwrap_err().to_string();
            assert!(e.contains(needle), "[{name}] {s:?}: {e}");
        }
        let cube = GpuTensor::zeros(ctx, &[2, 2, 10]).unwrap();
        let e = sample(ctx, &cube, &Sampling::greedy(), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("logits"), "[{name}] {e}");
    });
}

/// Per-row settings (a serving batch): each row draws exactly what the whole-batch sampler with
/// that row's setting draws for it, greedy, temperature, top-k and top-p mixed in one pass.
#[test]
fn per_row_settings_draw_what_each_setting_draws() {
    use wgpu_attention::kernels::sampling::{sample_into, sample_rows_into, SamplingRows};
    for_each_backend(|name, ctx| {
        let (batch, vocab) = (4, 37);
        let logits: Vec<f32> = random(&mut rng(12), batch * vocab, 3.0);
        let logits = GpuTensor::from_slice(ctx, &logits, &[batch, vocab]).unwrap();
        let settings = [
            Sampling::greedy(),
            Sampling::temperature(0.7, 5),
            Sampling::temperature(1.3, 9).top_k(4),
            Sampling::temperature(1.0, 2).top_p(0.8),
        ];
        let ids_buffer = || {
            ctx.device().create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 4 * batch as u64,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        let read = |ids: &wgpu::Buffer| -> Vec<u32> {
            let staging = ctx.device().create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 4 * batch as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            encoder.copy_buffer_to_buffer(ids, 0, &staging, 0, 4 * batch as u64);
            ctx.queue().submit([encoder.finish()]);
            staging
                .slice(..)
                .map_async(wgpu::MapMode::Read, |r| r.unwrap());
            ctx.device()
                .poll(wgpu::PollType::wait_indefinitely())
                .unwrap();
            let view = staging.slice(..).get_mapped_range().unwrap();
            let out: Vec<u32> = bytemuck::cast_slice(&view).to_vec();
            out
        };
        for draw in [0u64, 7] {
            let mut rows = SamplingRows::new(ctx, batch).unwrap();
            rows.write(ctx, &settings).unwrap();
            let per_row = ids_buffer();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            sample_rows_into(ctx, &mut encoder, &logits, &rows, draw, &per_row).unwrap();
            ctx.queue().submit([encoder.finish()]);
            let got = read(&per_row);
            for (row, setting) in settings.iter().enumerate() {
                let whole = ids_buffer();
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                sample_into(ctx, &mut encoder, &logits, setting, draw, &whole).unwrap();
                ctx.queue().submit([encoder.finish()]);
                assert_eq!(
                    got[row],
                    read(&whole)[row],
                    "[{name}] draw {draw} row {row}"
                );
            }
        }
        let mut rows = SamplingRows::new(ctx, batch).unwrap();
        assert!(rows.write(ctx, &settings[..2]).is_err());
        assert!(rows
            .write(ctx, &[Sampling::temperature(-1.0, 0); 4])
            .is_err());
    });
}
