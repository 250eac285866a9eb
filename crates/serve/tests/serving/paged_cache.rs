//! The paged key/value cache: decode attention and the cache append through a block table against
//! the f64 reference (GQA, ragged lengths, several queries per sequence, every decoding modifier,
//! split-KV), with the unused pool blocks holding NaN to prove they are never read; and the cache's
//! book-keeping: blocks as tokens arrive, forks sharing a prefix with copy-on-write at the first
//! divergent block, removal and truncation freeing blocks, a full pool refused with nothing changed.

use crate::common;

use common::*;
use half::f16;
use rand::seq::SliceRandom;
use wgpu_attention::kernels::kv_cache::{
    kv_cache_append_paged_into, kv_cache_gather_int8_into, kv_cache_gather_paged_into, BlockTable,
};
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::reference::kv_cache::{dequantize_int8_rows, gather_paged};
use wgpu_attention::{
    attention_decode_f16_into, attention_decode_int8_into, attention_decode_paged_into, Context,
    Error, ForwardViews, GpuTensor, GpuTensorF16, GpuTensorQ8, HalfCache, QuantizedCache, SeqLens,
};
use wgpu_attention_serve::{KvFormat, PagedKvCache, PagedKvCacheConfig};

/// A random placement of each sequence's `ceil(cap / page)` blocks in a pool with `spare` more
/// blocks than needed: `[batch, stride]` ids, distinct, shuffled.
fn placement(batch: usize, stride: usize, spare: usize, seed: u64) -> (Vec<u32>, usize) {
    let pool = batch * stride + spare;
    let mut ids: Vec<u32> = (0..pool as u32).collect();
    ids.shuffle(&mut rng(seed));
    (ids[..batch * stride].to_vec(), pool)
}

/// Scatters `cache [B, cap, H, D]` into a pool `[pool * page, H, D]` by `table`; every other row NaN.
fn scatter(
    cache: &[f32],
    [b, cap, h, d]: [usize; 4],
    table: &[u32],
    page: usize,
    pool: usize,
) -> Vec<f32> {
    let stride = cap.div_ceil(page);
    let row = h * d;
    let mut out = vec![f32::NAN; pool * page * row];
    for bi in 0..b {
        for p in 0..cap {
            let at = (table[bi * stride + p / page] as usize * page + p % page) * row;
            out[at..at + row].copy_from_slice(&cache[(bi * cap + p) * row..][..row]);
        }
    }
    out
}

/// Decode attention for `case` through a paged cache of `page`-row blocks holding `format`'s values
/// (f32, int8 or f16), against the reference over the values the pools hold.
fn check_paged(ctx: &Context, name: &str, case: &Case, page: usize, format: KvFormat) {
    let s = case.shape();
    let (q, k, v, _) = case.data();
    let stride = s.kv_seq.div_ceil(page);
    let (ids, pool) = placement(s.batch, stride, 3, 7);
    let mut table = BlockTable::new(ctx, s.batch, stride, page, pool).unwrap();
    table.write(ctx, &ids).unwrap();
    let [qv, _, _, _] = case.upload(ctx);
    let dims = [s.head_dim_qk, s.head_dim_v];
    let pools = [&k, &v].map(|x| x.as_slice());
    let pools: Vec<Vec<f32>> = pools
        .iter()
        .zip(dims)
        .map(|(x, d)| scatter(x, [s.batch, s.kv_seq, s.kv_heads, d], &ids, page, pool))
        .collect();
    let out = GpuTensor::zeros(ctx, &[s.batch, s.q_seq, s.heads, s.head_dim_v]).unwrap();
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq]).unwrap();
    let buffers = case.buffers(ctx);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let opts = case.options(&buffers);
    let out_view = out.heads().unwrap();
    let pool_shape = |i: usize| [pool * page, s.kv_heads, dims[i]];
    // What the pools hold, gathered back through the table: the keys and values the reference
    // attends over.
    let held = |values: &[f64], d: usize| -> Vec<f64> {
        (0..s.batch)
            .flat_map(|b| {
                let blocks = &ids[b * stride..][..stride];
                gather_paged(values, blocks, page, s.kv_seq, s.kv_heads * d)
            })
            .collect()
    };
    let (k_ref, v_ref) = match format {
        KvFormat::Int8 => {
            let [k_pool, v_pool] =
                [0, 1].map(|i| GpuTensorQ8::from_f32(ctx, &pools[i], &pool_shape(i)).unwrap());
            let cache = QuantizedCache {
                k: &k_pool,
                v: &v_pool,
                table: Some(&table),
            };
            attention_decode_int8_into(ctx, &mut encoder, &qv, cache, &out_view, &lse, &opts)
                .unwrap();
            ctx.queue().submit([encoder.finish()]);
            let values = |t: &GpuTensorQ8, d: usize| {
                held(&dequantize_int8_rows(&t.to_words(ctx).unwrap(), d), d)
            };
            (values(&k_pool, dims[0]), values(&v_pool, dims[1]))
        }
        KvFormat::F16 => {
            let [k_pool, v_pool] =
                [0, 1].map(|i| GpuTensorF16::from_f32(ctx, &pools[i], &pool_shape(i)).unwrap());
            let cache = HalfCache {
                k: &k_pool,
                v: &v_pool,
                table: Some(&table),
            };
            attention_decode_f16_into(ctx, &mut encoder, &qv, cache, &out_view, &lse, &opts)
                .unwrap();
            ctx.queue().submit([encoder.finish()]);
            let rounded =
                |x: &[f32]| -> Vec<f64> { x.iter().map(|&x| f16::from_f32(x).to_f64()).collect() };
            (rounded(&k), rounded(&v))
        }
        _ => {
            let [k_pool, v_pool] =
                [0, 1].map(|i| upload(ctx, &pools[i], [1, pool * page, s.kv_heads, dims[i]]));
            attention_decode_paged_into(
                ctx,
                &mut encoder,
                &ForwardViews {
                    q: &qv,
                    k: &k_pool,
                    v: &v_pool,
                    out: &out_view,
                    lse: &lse,
                },
                &table,
                &opts,
            )
            .unwrap();
            ctx.queue().submit([encoder.finish()]);
            (to_f64(&k), to_f64(&v))
        }
    };
    let masks = Masks {
        q_lens: None,
        kv_lens: None,
        ..case.masks()
    };
    let (q_lens, kv_lens) = (case.q_lens.clone().unwrap(), case.kv_lens.clone().unwrap());
    let (ref_out, ref_lse) =
        reference::attention_decode(&s, &to_f64(&q), &k_ref, &v_ref, &q_lens, &kv_lens, &masks);
    let what = format!(
        "[{name}] paged {} decode, page {page}, {}",
        format.name(),
        case.label()
    );
    // f32's tolerances, or the tensor-core family's where a prefill-shaped step runs on it.
    let (atol, rtol) = forward_tolerances(ctx);
    assert_close(
        &format!("{what} out"),
        &out.to_vec(ctx).unwrap(),
        &ref_out,
        atol,
        rtol,
    );
    let lse = lse.to_vec(ctx).unwrap();
    assert_lse_close(&what, &lse, &ref_lse, atol, rtol);
}

#[test]
fn paged_decode_matches_reference() {
    for_each_backend(|name, ctx| {
        // GQA, ragged lengths (one past a 64-key tile), several new queries, blocks of 16 and of 5.
        for page in [16, 5] {
            let case = Case::new(3, 3, 70, 4, 2, 16, 16)
                .causal()
                .q_lens(&[1, 3, 2])
                .kv_lens(&[70, 5, 33]);
            check_paged(ctx, name, &case, page, KvFormat::F32);
        }
        // The decoding modifiers, Dk != Dv.
        let case = Case::new(2, 2, 90, 2, 2, 24, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[90, 41])
            .window(20, 0)
            .alibi()
            .softcap(5.0)
            .sinks(&[0.5, -1.0])
            .magnitude(3.0);
        check_paged(ctx, name, &case, 8, KvFormat::F32);
        check_paged(ctx, name, &case, 8, KvFormat::Int8);
        let case = Case::new(2, 2, 70, 4, 2, 16, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[70, 3])
            .relative(8, 32, false);
        check_paged(ctx, name, &case, 16, KvFormat::F32);
        // Cosine scores and key clipping: the sequences' cached keys gathered (dequantised) into
        // scratch, then transformed.
        let case = Case::new(2, 2, 50, 4, 2, 16, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[50, 9])
            .cosine(10.0)
            .magnitude(4.0);
        check_paged(ctx, name, &case, 8, KvFormat::F32);
        check_paged(ctx, name, &case, 8, KvFormat::Int8);
        let case = Case::new(2, 2, 50, 2, 2, 12, 8)
            .causal()
            .q_lens(&[1, 2])
            .kv_lens(&[17, 30])
            .cosine_learned(&[5.0, 12.0])
            .key_clip(0.5);
        check_paged(ctx, name, &case, 16, KvFormat::F32);
        check_paged(ctx, name, &case, 16, KvFormat::Int8);
        // Prefill-shaped (64 new rows or more): the fused forward, reading the f32 pools through
        // the table (every family: paged_prefill_reads_the_pools_through_the_table), the int8
        // ones dequantised into scratch first.
        let case = Case::new(2, 70, 100, 4, 2, 16, 16)
            .causal()
            .q_lens(&[70, 40])
            .kv_lens(&[100, 61])
            .softcap(5.0);
        check_paged(ctx, name, &case, 16, KvFormat::F32);
        check_paged(ctx, name, &case, 16, KvFormat::Int8);
    });
    // Split-KV (a small loop budget forces several key splits and their merge).
    for_each_backend_with_loop_budget(3000, |name, ctx| {
        let case = Case::new(1, 1, 300, 2, 1, 16, 16)
            .causal()
            .q_lens(&[1])
            .kv_lens(&[300]);
        check_paged(ctx, name, &case, 32, KvFormat::F32);
        check_paged(ctx, name, &case, 32, KvFormat::Int8);
    });
}

/// Prefill-shaped steps (64 new rows or more) of every forward family read the pools through the
/// block table, f32, int8 and f16 (dequantised as they are staged): against the reference with
/// the pools' unused rows NaN, and compiled as the families' paged builds (the pipeline dump names
/// them `_paged`, `_paged_kvint8` and `_paged_kvf16`), not gathered into scratch.
#[test]
fn paged_prefill_reads_the_pools_through_the_table() {
    let dump = std::env::temp_dir().join(format!(
        "wgpu-attention-paged-prefill-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dump);
    let ran = std::sync::Mutex::new(Vec::new());
    for_each_forward_family_with_options(
        |opts| opts.dump_pipelines(&dump),
        |name, ctx| {
            for format in [KvFormat::F32, KvFormat::Int8, KvFormat::F16] {
                // Blocks of 5 rows (every tile crosses blocks), GQA, ragged lengths.
                let case = Case::new(2, 70, 90, 4, 2, 16, 16)
                    .causal()
                    .q_lens(&[70, 64])
                    .kv_lens(&[90, 64]);
                check_paged(ctx, name, &case, 5, format);
                // Dk != Dv, a modifier; f32 head dims that are no multiple of four (element
                // reads; int8 and f16 caches hold multiples of four).
                let dims = match format {
                    KvFormat::F32 => (10, 6),
                    _ => (12, 8),
                };
                let case = Case::new(1, 64, 75, 2, 1, dims.0, dims.1)
                    .causal()
                    .q_lens(&[64])
                    .kv_lens(&[75])
                    .softcap(5.0);
                check_paged(ctx, name, &case, 16, format);
            }
            ran.lock().unwrap().push(name.to_string());
        },
    );
    let names: Vec<String> = std::fs::read_dir(&dump)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dump);
    for name in ran.into_inner().unwrap() {
        let family = name.split('/').nth(1).unwrap_or_default().to_string();
        for stored in ["", "_kvint8", "_kvf16"] {
            let build = |n: &String| {
                let words = n.contains("_kv");
                n.starts_with(&format!("attention_forward_{family}"))
                    && n.contains(&format!("_paged{stored}"))
                    && (words || stored.is_empty())
                    && (!words || !stored.is_empty())
            };
            assert!(
                names.iter().any(build),
                "[{name}] no paged{stored} forward build was compiled: {names:?}"
            );
        }
    }
}

#[test]
fn paged_append_writes_through_the_table() {
    for_each_backend(|name, ctx| {
        let (b, l, h, d, page) = (2, 3, 2, 4, 4);
        let stride = 3;
        let (ids, pool) = placement(b, stride, 2, 11);
        let mut table = BlockTable::new(ctx, b, stride, page, pool).unwrap();
        table.write(ctx, &ids).unwrap();
        let new = random(&mut rng(3), b * l * h * d, 1.0);
        let pool_t = GpuTensor::zeros(ctx, &[pool * page, h, d]).unwrap();
        // Sequence 0 adds 3 tokens after 2 (positions 2..5, across a block boundary); sequence 1
        // adds 2 after 7.
        let lens = SeqLens::new(ctx, Some(&[3, 2]), Some(&[5, 9])).unwrap();
        let new_t = upload(ctx, &new, [b, l, h, d]);
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        kv_cache_append_paged_into(ctx, &mut encoder, &new_t, &pool_t, &table, &lens).unwrap();
        ctx.queue().submit([encoder.finish()]);
        let got = pool_t.to_vec(ctx).unwrap();
        let row = h * d;
        for (bi, (start, count)) in [(2, 3), (7, 2)].into_iter().enumerate() {
            let gathered = gather_paged(
                &to_f64(&got),
                &ids[bi * stride..][..stride],
                page,
                start + count,
                row,
            );
            for li in 0..count {
                let want = &new[(bi * l + li) * row..][..row];
                let have = &gathered[(start + li) * row..][..row];
                assert!(
                    want.iter().zip(have).all(|(&w, &g)| w as f64 == g),
                    "[{name}] sequence {bi} position {}",
                    start + li
                );
            }
        }
        // A table for another batch, and ids past the pool, are refused.
        let other = BlockTable::new(ctx, 3, stride, page, pool).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let err = kv_cache_append_paged_into(ctx, &mut encoder, &new_t, &pool_t, &other, &lens);
        assert!(
            matches!(
                err,
                Err(Error::Shape {
                    arg: "block table",
                    ..
                })
            ),
            "{err:?}"
        );
        let err = table.write(ctx, &vec![pool as u32; b * stride]);
        assert!(
            matches!(
                err,
                Err(Error::Shape {
                    arg: "block table",
                    ..
                })
            ),
            "{err:?}"
        );
    });
}

/// Appends `count` tokens of recognisable values (`seq * 1000 + position`) to each fed slot.
fn feed(ctx: &Context, cache: &mut PagedKvCache, new: &[u32], tag: &[f32]) {
    let slots = new.len();
    let l = *new.iter().max().unwrap() as usize;
    let c = *cache.config();
    let (h, d) = (c.kv_heads, c.dims[0]);
    let step = cache.prepare(ctx, new).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let mut rows = vec![0.0f32; slots * l.max(1) * h * d];
    for (s, &n) in new.iter().enumerate() {
        for li in 0..n as usize {
            let position = step.total[s] as usize - n as usize + li;
            let value = tag[s] * 1000.0 + position as f32;
            rows[(s * l.max(1) + li) * h * d..][..h * d].fill(value);
        }
    }
    let view = upload(ctx, &rows, [slots, l.max(1), h, d]);
    let lens = SeqLens::new(ctx, Some(&step.new), Some(&step.total)).unwrap();
    for [k, v] in cache.layers() {
        for t in [k, v] {
            t.append_into(ctx, &mut encoder, &view, Some(cache.table()), &lens)
                .unwrap();
        }
    }
    ctx.queue().submit([encoder.finish()]);
    cache.advance(&step);
}

/// Slot `slot`'s cached values (one per position) in layer 0's keys.
fn contents(ctx: &Context, cache: &PagedKvCache, slot: usize) -> Vec<f32> {
    let c = *cache.config();
    let row = c.kv_heads * c.dims[0];
    let pool = to_f64(&cache.layers()[0][0].to_vec(ctx).unwrap());
    let len = cache.len(slot).unwrap();
    gather_paged(&pool, cache.blocks(slot).unwrap(), c.page, len, row)
        .chunks(row)
        .map(|r| r[0] as f32)
        .collect()
}

#[test]
fn sequences_fork_with_copy_on_write_and_free_their_blocks() {
    // Rows of one repeated value are exact in int8 too (each is its row's scale), and these
    // integers below 2048 in f16, so the same contents are expected of every format:
    // copy-on-write moves int8 words and scales, and f16 pairs, whole.
    for_each_backend(|name, ctx| {
        for format in [KvFormat::F32, KvFormat::Int8, KvFormat::F16] {
            let name = &format!("{name} {}", format.name());
            let config = PagedKvCacheConfig::new(2, 1, 4, 4, 8, 3, 16).with_format(format);
            let mut cache = PagedKvCache::new(ctx, config).unwrap();
            let (a, b) = (0, 1);
            cache.add_sequence(a).unwrap();
            // A 6-token prompt: two blocks, the second half full.
            feed(ctx, &mut cache, &[6, 0, 0], &[1.0, 0.0, 0.0]);
            assert_eq!(cache.free_blocks(), 6, "[{name}] blocks follow the tokens");
            // The fork shares both blocks: nothing is copied or allocated.
            cache.fork(a, b).unwrap();
            assert_eq!(cache.free_blocks(), 6);
            assert_eq!(cache.blocks(a), cache.blocks(b));
            // Both continue differently: each copies the shared, half-full block before writing.
            feed(ctx, &mut cache, &[1, 1, 0], &[1.0, 2.0, 0.0]);
            let (ba, bb) = (
                cache.blocks(a).unwrap().to_vec(),
                cache.blocks(b).unwrap().to_vec(),
            );
            assert_eq!(ba[0], bb[0], "[{name}] the full first block stays shared");
            assert_ne!(ba[1], bb[1], "[{name}] the divergent block is copied");
            let prefix: Vec<f32> = (0..6).map(|p| 1000.0 + p as f32).collect();
            let mut want_a = prefix.clone();
            want_a.push(1006.0);
            let mut want_b = prefix.clone();
            want_b.push(2006.0);
            assert_eq!(contents(ctx, &cache, a), want_a, "[{name}] parent");
            assert_eq!(contents(ctx, &cache, b), want_b, "[{name}] fork");
            // Removing the parent frees only what the fork does not hold.
            let free = cache.free_blocks();
            cache.remove(a).unwrap();
            assert_eq!(
                cache.free_blocks(),
                free + 1,
                "[{name}] the shared prefix block stays"
            );
            assert_eq!(contents(ctx, &cache, b), want_b);
            // Truncating (a rejected draft) frees blocks past the kept tokens.
            feed(ctx, &mut cache, &[0, 6, 0], &[0.0, 2.0, 0.0]);
            let free = cache.free_blocks();
            cache.truncate(b, 5).unwrap();
            assert_eq!(
                cache.free_blocks(),
                free + 2,
                "[{name}] 13 tokens in 4 blocks -> 5 in 2"
            );
            assert_eq!(contents(ctx, &cache, b), prefix[..5].to_vec());
        }
    });
}

#[test]
fn a_full_pool_is_refused_and_nothing_changes() {
    for_each_backend(|_, ctx| {
        let config = PagedKvCacheConfig::new(1, 1, 4, 4, 3, 2, 32);
        let mut cache = PagedKvCache::new(ctx, config).unwrap();
        let (a, b) = (0, 1);
        cache.add_sequence(a).unwrap();
        cache.add_sequence(b).unwrap();
        feed(ctx, &mut cache, &[8, 0], &[1.0, 0.0]);
        let err = cache.prepare(ctx, &[1, 5]);
        assert!(
            matches!(
                err,
                Err(Error::KvCacheFull {
                    needed: 3,
                    free: 1,
                    total: 3
                })
            ),
            "{err:?}"
        );
        assert_eq!(
            (cache.len(a), cache.len(b), cache.free_blocks()),
            (Some(8), Some(0), 1)
        );
        // Past max_len, an empty slot fed, the wrong slot count: typed errors too.
        for new in [[25, 0].as_slice(), &[0, 40], &[1]] {
            assert!(cache.prepare(ctx, new).is_err(), "{new:?}");
        }
        cache.remove(b).unwrap();
        let err = cache.prepare(ctx, &[0, 1]);
        assert!(matches!(err, Err(Error::Shape { .. })), "{err:?}");
        // Forks need a sequence to continue and an empty slot to start in.
        assert!(cache.fork(b, b).is_err());
        assert!(cache.fork(a, a).is_err());
        assert!(cache.add_sequence(a).is_err());
        assert!(cache.add_sequence(7).is_err());
    });
}

/// The gather out of a paged pool against the reference: each sequence's first positions through
/// its table row, zeros past its length; the rest of the pool (NaN) never read.
#[test]
fn paged_gather_matches_reference() {
    for_each_backend(|name, ctx| {
        let ([b, cap, h, d], page, rows): ([usize; 4], usize, usize) = ([3, 40, 2, 8], 8, 33);
        let stride = cap.div_ceil(page);
        let (ids, pool) = placement(b, stride, 2, 11);
        let mut table = BlockTable::new(ctx, b, stride, page, pool).unwrap();
        table.write(ctx, &ids).unwrap();
        let cache: Vec<f32> = (0..b * cap * h * d).map(|i| i as f32 * 0.5 - 7.0).collect();
        let pooled = scatter(&cache, [b, cap, h, d], &ids, page, pool);
        let pool_tensor = upload(ctx, &pooled, [1, pool * page, h, d]);
        let kv_lens = [33u32, 9, 20];
        let lens = SeqLens::new(ctx, Some(&[1, 1, 1]), Some(&kv_lens)).unwrap();
        let out = GpuTensor::zeros(ctx, &[b, rows, h, d]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        kv_cache_gather_paged_into(ctx, &mut encoder, &pool_tensor, &table, &lens, rows, &out)
            .unwrap();
        ctx.queue().submit([encoder.finish()]);
        // What the gather of `rows` positions should write from a pool holding `values`.
        let expected = |values: &[f64]| -> Vec<f32> {
            (0..b)
                .flat_map(|bi| {
                    let len = kv_lens[bi] as usize;
                    let mut seq = gather_paged(values, &ids[bi * stride..], page, len, h * d);
                    seq.resize(rows * h * d, 0.0);
                    seq.into_iter().map(|x| x as f32)
                })
                .collect()
        };
        let pooled_f64: Vec<f64> = pooled.iter().map(|&x| x as f64).collect();
        let want = expected(&pooled_f64);
        assert_eq!(out.to_vec(ctx).unwrap(), want, "[{name}] gathered rows");
        // An int8 pool, dequantised as it is gathered; and the same rows as a contiguous int8 cache.
        let q8_pool = GpuTensorQ8::from_f32(ctx, &pooled, &[pool * page, h, d]).unwrap();
        let held = dequantize_int8_rows(&q8_pool.to_words(ctx).unwrap(), d);
        let contiguous: Vec<f32> = (0..b)
            .flat_map(|bi| gather_paged(&held, &ids[bi * stride..], page, cap, h * d))
            .map(|x| x as f32)
            .collect();
        let q8_cache = GpuTensorQ8::from_f32(ctx, &contiguous, &[b, cap, h, d]).unwrap();
        let want = expected(&held);
        for (what, table) in [("paged", Some(&table)), ("contiguous", None)] {
            let cache = if table.is_some() { &q8_pool } else { &q8_cache };
            let out = GpuTensor::zeros(ctx, &[b, rows, h, d]).unwrap();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            kv_cache_gather_int8_into(ctx, &mut encoder, cache, table, &lens, rows, &out).unwrap();
            ctx.queue().submit([encoder.finish()]);
            // The reference dequantises in f64, the kernel in f32 (two roundings): within 2^-22
            // of the largest value. Re-quantising the contiguous copy's dequantised rows keeps their
            // words and scales, so both layouts hold the same values.
            let got = out.to_vec(ctx).unwrap();
            let largest = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= largest * 2f32.powi(-22),
                "[{name}] int8 {what} gather: {worst} (largest {largest})"
            );
        }
        // More rows than the table holds: refused, nothing recorded.
        let too_many = GpuTensor::zeros(ctx, &[b, cap + 1, h, d]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let refused = kv_cache_gather_paged_into(
            ctx,
            &mut encoder,
            &pool_tensor,
            &table,
            &lens,
            cap + 1,
            &too_many,
        );
        assert!(matches!(refused, Err(Error::Shape { .. })), "{refused:?}");
    });
}

/// The reference gather against a direct construction (the layout the kernels read).
#[test]
fn reference_gather_follows_the_table() {
    let (page, row) = (2, 3);
    let pool: Vec<f64> = (0..4 * page * row).map(|i| i as f64).collect();
    let got = gather_paged(&pool, &[3, 1], page, 3, row);
    let want: Vec<f64> = [6, 7, 2]
        .iter()
        .flat_map(|&r| (0..row).map(move |c| (r * row + c) as f64))
        .collect();
    assert_eq!(got, want);
}

/// A step prepared but never recorded leaves blocks allocated ahead of the tokens; a fork then
/// shares only the blocks holding tokens, so neither sequence writes into the other's.
#[test]
fn a_fork_after_an_unrecorded_step_keeps_the_sequences_apart() {
    for_each_backend(|name, ctx| {
        let config = PagedKvCacheConfig::new(1, 1, 4, 4, 8, 2, 16);
        let mut cache = PagedKvCache::new(ctx, config).unwrap();
        cache.add_sequence(0).unwrap();
        feed(ctx, &mut cache, &[4, 0], &[1.0, 0.0]);
        // Prepared (a fifth block allocated for positions 4..8) but the step never ran.
        cache.prepare(ctx, &[3, 0]).unwrap();
        assert_eq!(cache.blocks(0).unwrap().len(), 2);
        cache.fork(0, 1).unwrap();
        assert_eq!(
            cache.blocks(1).unwrap().len(),
            1,
            "[{name}] only the full block is shared"
        );
        feed(ctx, &mut cache, &[2, 2], &[1.0, 2.0]);
        let prefix: Vec<f32> = (0..4).map(|p| 1000.0 + p as f32).collect();
        let mut want0 = prefix.clone();
        want0.extend([1004.0, 1005.0]);
        let mut want1 = prefix;
        want1.extend([2004.0, 2005.0]);
        assert_eq!(contents(ctx, &cache, 0), want0, "[{name}] parent");
        assert_eq!(contents(ctx, &cache, 1), want1, "[{name}] fork");
        // A step prepared for more tokens than the next one feeds: its extra blocks are reused.
        cache.prepare(ctx, &[7, 0]).unwrap();
        let held = cache.blocks(0).unwrap().len();
        feed(ctx, &mut cache, &[1, 0], &[1.0, 0.0]);
        assert_eq!(
            cache.blocks(0).unwrap().len(),
            held,
            "[{name}] no block allocated"
        );
        want0.push(1006.0);
        assert_eq!(contents(ctx, &cache, 0), want0, "[{name}] parent after");
    });
}
