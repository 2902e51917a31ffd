//! Speed measurements, reported as medians over repeated runs (never asserted in tests).

use crate::text::chat::Message;
use crate::engine::cpu::model::Model;
use crate::sampling::argmax;
use crate::speculative::{Draft, DraftHead, HeadRows};
use crate::loading::target::Target;
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;

pub mod device;

#[derive(Serialize)]
pub struct DecodeBench {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub runs: usize,
    pub threads: usize,
    /// Median tokens/s of greedy one-token steps after the prompt.
    pub decode_tok_s: f64,
    /// Median tokens/s of the prompt forwarded as one block into an empty cache.
    pub prefill_tok_s: f64,
    /// Median seconds of one forward of `block` tokens ÷ median seconds of a one-token forward, at the same position.
    pub block: usize,
    pub block_cost_ratio: f64,
    /// Median tokens/s, all sequences together, of `sequences` sequences decoded one batched forward a step (how
    /// training data is generated).
    pub sequences: usize,
    pub batched_decode_tok_s: f64,
    /// Median seconds of `sequences` blocks of `block` rows (verification blocks, logits for every row) forwarded
    /// one sequence at a time, and together in one batched forward (how a batched sweep verifies).
    pub blocks_apart_secs: f64,
    pub blocks_together_secs: f64,
    pub decode_tok_s_runs: Vec<f64>,
    pub prefill_tok_s_runs: Vec<f64>,
    pub batched_decode_tok_s_runs: Vec<f64>,
    /// Matrices per weight type, and which rows meet 8-bit activations (`tensor::Activations`).
    pub weight_types: std::collections::BTreeMap<&'static str, usize>,
    pub activations: &'static str,
    /// Bytes the loaded weights occupy, the model file's size, and the process's peak resident memory at the end
    /// (Linux; 0 elsewhere).
    pub weight_bytes: usize,
    pub file_bytes: u64,
    pub peak_rss_bytes: u64,
}

/// The process's peak resident set size (`VmHWM`), 0 where /proc does not say.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    kib.unwrap_or(0) * 1024
}

pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Target-only decode and prefill speed on the chat prompt `question`, after one warm-up run.
pub fn decode(target: &Target, question: &str, new_tokens: usize, runs: usize, block: usize, sequences: usize) -> Result<DecodeBench> {
    let prompt = target.tokenizer.chat_prompt(&[Message::new("user", question)])?;
    let model = &target.model;
    let (mut decode_runs, mut prefill_runs, mut batched_runs) = (Vec::new(), Vec::new(), Vec::new());
    let v = model.config.vocab;
    for run in 0..=runs {
        let mut cache = model.new_cache();
        let t = Instant::now();
        let mut logits = model.forward(&prompt, &mut cache, &[prompt.len() - 1], &[])?.logits;
        let prefill = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..new_tokens {
            let next = argmax(&logits);
            logits = model.forward(&[next], &mut cache, &[0], &[])?.logits;
        }
        let decode = t.elapsed().as_secs_f64();
        let mut caches = vec![model.new_cache(); sequences];
        let mut next = Vec::with_capacity(sequences);
        for cache in &mut caches {
            next.push(argmax(&model.forward(&prompt, cache, &[prompt.len() - 1], &[])?.logits));
        }
        let mut batch: Vec<&mut crate::engine::cpu::model::Cache> = caches.iter_mut().collect();
        let t = Instant::now();
        for _ in 0..new_tokens {
            let logits = model.forward_batch(&next, &mut batch, &[])?.logits;
            next.iter_mut().zip(logits.chunks_exact(v)).for_each(|(n, l)| *n = argmax(l));
        }
        let batched = t.elapsed().as_secs_f64();
        if run > 0 {
            prefill_runs.push(prompt.len() as f64 / prefill);
            decode_runs.push(new_tokens as f64 / decode);
            batched_runs.push((sequences * new_tokens) as f64 / batched);
        }
    }
    let block_cost_ratio = block_cost(model, &prompt, block, runs.max(5) * 4)?;
    let (blocks_apart_secs, blocks_together_secs) = blocks_batched(model, &prompt, block, sequences, runs.max(5))?;
    Ok(DecodeBench {
        prompt_tokens: prompt.len(),
        new_tokens,
        runs,
        threads: crate::engine::cpu::tensor::pool().current_num_threads(),
        decode_tok_s: median(&decode_runs),
        prefill_tok_s: median(&prefill_runs),
        block,
        block_cost_ratio,
        sequences,
        batched_decode_tok_s: median(&batched_runs),
        blocks_apart_secs,
        blocks_together_secs,
        decode_tok_s_runs: decode_runs,
        prefill_tok_s_runs: prefill_runs,
        batched_decode_tok_s_runs: batched_runs,
        weight_types: model.weight_types(),
        activations: crate::engine::cpu::tensor::Activations::get().name(),
        weight_bytes: model.weight_bytes(),
        file_bytes: std::fs::metadata(&target.source).map_or(0, |m| m.len()),
        peak_rss_bytes: peak_rss_bytes(),
    })
}

/// Greedy continuation of `prompt` by `new_tokens` tokens on the CPU engine, with no stop token.
pub fn engine_greedy(model: &Model, prompt: &[u32], new_tokens: usize) -> Result<Vec<u32>> {
    let mut cache = model.new_cache();
    crate::speculative::decode::greedy_steps(prompt, new_tokens, |tokens| Ok(argmax(&model.forward(tokens, &mut cache, &[tokens.len() - 1], &[])?.logits)))
}

/// What a verification step costs relative to a plain decode step: a `block`-token forward (logits for every
/// row, as verification needs) against a one-token forward, both on top of the prompt.
fn block_cost(model: &Model, prompt: &[u32], block: usize, reps: usize) -> Result<f64> {
    let mut cache = model.new_cache();
    model.forward(prompt, &mut cache, &[], &[])?;
    let base = cache.len();
    let tokens: Vec<u32> = prompt.iter().cycle().take(block).copied().collect();
    let rows: Vec<usize> = (0..block).collect();
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        model.forward(&tokens[..1], &mut cache, &[0], &[])?;
        one.push(t.elapsed().as_secs_f64());
        cache.truncate(base);
        let t = Instant::now();
        model.forward(&tokens, &mut cache, &rows, &[])?;
        many.push(t.elapsed().as_secs_f64());
        cache.truncate(base);
    }
    Ok(median(&many) / median(&one))
}

/// Median seconds of `sequences` verification blocks of `block` rows on top of the prompt: forwarded one by one,
/// and in one `forward_sequences`.
fn blocks_batched(model: &Model, prompt: &[u32], block: usize, sequences: usize, reps: usize) -> Result<(f64, f64)> {
    let mut caches = vec![model.new_cache(); sequences];
    for cache in &mut caches {
        model.forward(prompt, cache, &[], &[])?;
    }
    let base = caches[0].len();
    let tokens: Vec<u32> = prompt.iter().cycle().take(block * sequences).copied().collect();
    let rows: Vec<usize> = (0..block * sequences).collect();
    let (mut apart, mut together) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        for (cache, tokens) in caches.iter_mut().zip(tokens.chunks_exact(block)) {
            model.forward(tokens, cache, &rows[..block], &[])?;
        }
        apart.push(t.elapsed().as_secs_f64());
        caches.iter_mut().for_each(|c| c.truncate(base));
        let mut batch: Vec<&mut crate::engine::cpu::model::Cache> = caches.iter_mut().collect();
        let t = Instant::now();
        model.forward_sequences(&tokens, &mut batch, &vec![block; sequences], &rows, &[])?;
        together.push(t.elapsed().as_secs_f64());
        caches.iter_mut().for_each(|c| c.truncate(base));
    }
    Ok((median(&apart), median(&together)))
}

/// Draft-head and draft-step cost at one keep size and head mode.
#[derive(Serialize)]
pub struct HeadBench {
    pub ratio: f64,
    pub head: String,
    pub kept: usize,
    /// Median seconds of one head evaluation (one hidden row → logits).
    pub head_secs: f64,
    /// Median seconds of one drafting round of k tokens.
    pub draft_step_secs: f64,
}

/// Median seconds of one evaluation of `head` (one hidden row → logits) over `reps` calls.
pub fn head_secs<M: HeadRows>(head: &DraftHead<M>, reps: usize) -> Result<f64> {
    let hidden_row = &head.probe()?;
    let mut logits = Vec::new();
    let mut scratch = M::Scratch::default();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        head.logits(hidden_row, &mut logits, &mut scratch)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(&times))
}

/// Head and draft-step time for each ratio and head mode (`None` = the full head), on the chat prompt `question`.
pub fn draft_heads(
    target: &Target,
    draft: &mut dyn Draft<Model>,
    freqs: &crate::vocab::Frequencies,
    ratios: &[f64],
    k: usize,
    reps: usize,
    question: &str,
) -> Result<Vec<HeadBench>> {
    use crate::speculative::{Context, DraftMode, HeadMode, Proposal};
    use crate::sampling::Sampling;
    let prompt = target.tokenizer.chat_prompt(&[Message::new("user", question)])?;
    let model = &target.model;
    let mut cache = model.new_cache();
    let fwd = model.forward(&prompt, &mut cache, &[prompt.len() - 1], &draft.target_layers())?;
    let mut features = crate::engine::cpu::CpuFeatures::new(model.config.hidden, &draft.target_layers());
    features.append(&fwd.hidden, &fwd.layer_inputs);
    let mut tokens = prompt.clone();
    tokens.push(argmax(&fwd.logits));
    let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(0);
    let mut out = Vec::new();
    let mut cases: Vec<(f64, Option<HeadMode>)> = vec![(0.0, None)];
    for &r in ratios.iter().filter(|&&r| r > 0.0) {
        cases.push((r, Some(HeadMode::Slice)));
        cases.push((r, Some(HeadMode::Mask)));
    }
    for (ratio, mode) in cases {
        let keep = match mode {
            Some(_) => Some(freqs.keep_set(crate::vocab::KeepRule::Ratio(ratio), model.config.vocab, &target.tokenizer.stop_ids)?),
            None => None,
        };
        let head = DraftHead::new(draft.lm_head(), keep, mode.unwrap_or(HeadMode::Slice))?;
        let mut step_times = Vec::with_capacity(reps);
        let mut proposal = Proposal::default();
        let ctx = Context { tokens: &tokens, features: &features };
        draft.reset();
        draft.propose(&ctx, k, &head, DraftMode::Argmax, Sampling::GREEDY, &mut rng, &mut proposal)?;
        for _ in 0..reps {
            // The steady state of decoding: one new token to catch up on, then k drafts.
            draft.rollback(tokens.len() - 1, 0)?;
            let t = Instant::now();
            draft.propose(&ctx, k, &head, DraftMode::Argmax, Sampling::GREEDY, &mut rng, &mut proposal)?;
            step_times.push(t.elapsed().as_secs_f64());
        }
        out.push(HeadBench {
            ratio,
            head: mode.map_or("full".into(), |m| format!("{m:?}").to_lowercase()),
            kept: head.kept(),
            head_secs: head_secs(&head, reps)?,
            draft_step_secs: median(&step_times),
        });
    }
    Ok(out)
}

#[derive(Serialize)]
pub struct FastPathBench {
    pub ratios: Vec<f64>,
    pub prompts: usize,
    pub k: usize,
    /// Seconds for every ratio run as its own speculative loop.
    pub independent_secs: f64,
    /// Seconds for the same matrix through `decode::greedy_turns` (one target pass per prompt).
    pub fast_path_secs: f64,
    /// Whether both produced the same acceptance counts.
    pub counts_agree: bool,
}

/// A T = 0 sweep over `ratios` on `prompts`, run both ways; `make_draft` builds one draft instance.
pub fn fast_path<'a>(
    target: &'a Target,
    make_draft: &mut dyn FnMut() -> Result<Box<dyn Draft<Model> + 'a>>,
    freqs: &crate::vocab::Frequencies,
    ratios: &[f64],
    prompts: &[Vec<u32>],
    k: usize,
    max_new_tokens: usize,
) -> Result<FastPathBench> {
    use crate::speculative::{greedy_turns, speculative_turn, DraftMode, HeadMode, SpecConfig};
    use crate::sampling::Sampling;
    let vocab = target.model.config.vocab;
    let stop = &target.tokenizer.stop_ids;
    let mut drafts = ratios.iter().map(|_| make_draft()).collect::<Result<Vec<_>>>()?;
    let heads = drafts
        .iter()
        .zip(ratios)
        .map(|(d, &r)| {
            let keep = if r > 0.0 { Some(freqs.keep_set(crate::vocab::KeepRule::Ratio(r), vocab, stop)?) } else { None };
            DraftHead::new(d.lm_head(), keep, HeadMode::Slice)
        })
        .collect::<Result<Vec<_>>>()?;
    let strip = |r: &crate::speculative::decode::TurnRecord| (r.drafts, r.accepted, r.draft_tokens, r.accepted_per_pos.clone());
    let cfg = SpecConfig { k, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens };
    let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(0);
    let t = Instant::now();
    let mut independent = Vec::new();
    for prompt in prompts {
        for (d, h) in drafts.iter_mut().zip(&heads) {
            independent.push(strip(&speculative_turn(&target.model, stop, d.as_mut(), h, prompt, &cfg, &mut rng)?.1));
        }
    }
    let independent_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut fast = Vec::new();
    for prompt in prompts {
        let heads: Vec<&DraftHead<_>> = heads.iter().collect();
        fast.extend(greedy_turns(&target.model, stop, drafts[0].as_mut(), &heads, prompt, k, max_new_tokens)?.1.iter().map(strip));
    }
    let fast_path_secs = t.elapsed().as_secs_f64();
    Ok(FastPathBench {
        ratios: ratios.to_vec(),
        prompts: prompts.len(),
        k,
        independent_secs,
        fast_path_secs,
        counts_agree: independent == fast,
    })
}

/// One point of the LM-head benchmark: draft logits `[B, H] × [H, V′]`.
#[derive(Clone, Debug, Serialize)]
pub struct HeadPoint {
    pub ratio: f64,
    pub kept: usize,
    pub batch: usize,
    pub dtype: String,
    pub median_secs: f64,
    /// Weights + activations + logits, each moved once.
    pub bytes: f64,
    /// 2 · B · H · V′.
    pub flops: f64,
    pub bytes_per_sec: f64,
    pub flops_per_sec: f64,
    /// FLOPs per byte.
    pub intensity: f64,
    /// Achieved FLOP/s ÷ what the roofline allows at this intensity: min(peak FLOP/s, intensity × bandwidth).
    pub roofline_share: f64,
    /// On a device, where the engine pads the kept rows to a multiple of 128 and runs one row through its own
    /// matrix-vector kernel: candle's matmul over exactly the kept rows (the head before either), for comparison.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matmul_exact_secs: Option<f64>,
}

/// The machine's ceilings as measured here: read bandwidth of a 1 GiB buffer on every thread, and the best FLOP/s
/// of a large dense f32 matrix product (candle's gemm), which is what this CPU's cores can sustain.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    pub bytes_per_sec: f64,
    pub flops_per_sec: f64,
}

pub fn roofline() -> Result<Roofline> {
    Ok(Roofline { bytes_per_sec: read_bandwidth(), flops_per_sec: gemm_flops()? })
}

/// Median read bandwidth of a 1 GiB buffer summed on every thread.
pub fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buffer = vec![1.0f32; 1 << 28];
    let read: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            // Sixteen independent sums per chunk, so the adds vectorise and memory, not the add chain, is the limit.
            let lanes = |c: &[f32]| c.chunks_exact(16).fold([0.0f32; 16], |mut acc, x| {
                acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
                acc
            });
            let sum: f32 = crate::engine::cpu::tensor::pool().install(|| buffer.par_chunks(1 << 16).map(|c| lanes(c).iter().sum::<f32>()).sum());
            std::hint::black_box(sum);
            (buffer.len() * 4) as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    median(&read)
}

/// Best FLOP/s of five 1024³ f32 products through candle's CPU gemm.
fn gemm_flops() -> Result<f64> {
    let n = 1024;
    let a = candle_core::Tensor::ones((n, n), candle_core::DType::F32, &candle_core::Device::Cpu)?;
    let flops: Vec<f64> = (0..5)
        .map(|_| -> Result<f64> {
            let t = Instant::now();
            std::hint::black_box(a.matmul(&a)?);
            Ok(2.0 * (n * n * n) as f64 / t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    Ok(flops.iter().cloned().fold(0.0, f64::max))
}

/// At least 3 timed runs of `f`, more while they take under a second in all; the median seconds.
pub fn median_secs(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (times.len() < 21 && start.elapsed().as_secs_f64() < 1.0) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(&times))
}

impl HeadPoint {
    /// The point for `batch` rows against `kept` weight rows of `weight_bytes`, `elem` bytes per activation.
    #[allow(clippy::too_many_arguments)]
    pub fn new(ratio: f64, kept: usize, batch: usize, hidden: usize, dtype: &str, weight_bytes: usize, elem: usize, secs: f64, roof: Roofline) -> HeadPoint {
        let bytes = (weight_bytes + elem * batch * hidden + elem * batch * kept) as f64;
        let flops = 2.0 * (batch * hidden * kept) as f64;
        let intensity = flops / bytes;
        let attainable = roof.flops_per_sec.min(intensity * roof.bytes_per_sec);
        HeadPoint {
            ratio,
            kept,
            batch,
            dtype: dtype.into(),
            median_secs: secs,
            bytes,
            flops,
            bytes_per_sec: bytes / secs,
            flops_per_sec: flops / secs,
            intensity,
            roofline_share: flops / secs / attainable,
            matmul_exact_secs: None,
        }
    }
}

/// `rows` × `cols` weights of `dtype` in a fixed pattern (times do not depend on the values): plain types from
/// `pattern`, quantized blocks from a byte pattern.
fn pattern_storage(dtype: &str, rows: usize, cols: usize, pattern: impl Fn(usize) -> f32) -> Result<crate::engine::cpu::tensor::Storage> {
    use crate::engine::cpu::kquants::{BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
    use crate::engine::cpu::tensor::{BlockQ4_0, BlockQ4_1, BlockQ8_0, Storage, QK};
    use half::f16;
    let byte = |i: usize| (i * 37 % 251) as u8;
    let d = f16::from_f32(0.01);
    let n = rows * cols;
    let blocks = |per: usize| 0..n / per;
    Ok(match dtype {
        "f32" => Storage::F32((0..n).map(pattern).collect()),
        "f16" => Storage::F16((0..n).map(|i| f16::from_f32(pattern(i))).collect()),
        "q4_0" => Storage::Q4_0(blocks(QK).map(|b| BlockQ4_0 { d, qs: std::array::from_fn(|i| byte(b + i)) }).collect()),
        "q4_1" => Storage::q4_1(blocks(QK).map(|b| BlockQ4_1 { d, m: d, qs: std::array::from_fn(|i| byte(b + i)) }).collect(), cols),
        "q8_0" => Storage::q8_0(blocks(QK).map(|b| BlockQ8_0 { d, qs: std::array::from_fn(|i| byte(b + i) as i8) }).collect(), cols),
        "q4_k" => Storage::Q4K(blocks(QK_K).map(|b| BlockQ4K { d, dmin: d, scales: std::array::from_fn(|i| byte(b + i)), qs: std::array::from_fn(|i| byte(b + i)) }).collect()),
        "q5_k" => Storage::Q5K(
            blocks(QK_K)
                .map(|b| BlockQ5K { d, dmin: d, scales: std::array::from_fn(|i| byte(b + i)), qh: std::array::from_fn(|i| byte(b + i)), qs: std::array::from_fn(|i| byte(b + i)) })
                .collect(),
        ),
        "q6_k" => Storage::Q6K(
            blocks(QK_K)
                .map(|b| BlockQ6K { ql: std::array::from_fn(|i| byte(b + i)), qh: std::array::from_fn(|i| byte(b + i)), scales: std::array::from_fn(|i| byte(b + i) as i8), d })
                .collect(),
        ),
        other => anyhow::bail!("--dtype {other}: the CPU head benchmark runs f32, f16, q4_0, q4_1, q8_0, q4_k, q5_k or q6_k weights"),
    })
}

/// Median time of the draft logits for every keep size (`ratios` of `vocab`) and batch size, on frspec's own
/// kernel with weights in `dtype` (plain or block-quantized, laid out as a model's would be) and the process's
/// activations (8-bit by default). Values do not change the time, so the weights are a fixed pattern.
pub fn head(hidden: usize, vocab: usize, batches: &[usize], ratios: &[f64], dtype: &str, roof: Roofline) -> Result<Vec<HeadPoint>> {
    use crate::engine::cpu::tensor::{Matrix, MatmulScratch};
    let pattern = |i: usize| ((i % 17) as f32 - 8.0) * 0.01;
    let mut points = Vec::new();
    for &ratio in ratios {
        let kept = crate::vocab::kept_for_ratio(ratio, vocab);
        let storage = pattern_storage(dtype, kept, hidden, pattern)?;
        let w = Matrix { rows: kept, cols: hidden, storage };
        let mut scratch = MatmulScratch::default();
        for &b in batches {
            let x: Vec<f32> = (0..b * hidden).map(pattern).collect();
            let mut out = vec![0.0f32; b * kept];
            let secs = median_secs(|| {
                w.matmul(&x, &mut out, &mut scratch);
                Ok(())
            })?;
            points.push(HeadPoint::new(ratio, kept, b, hidden, dtype, w.bytes(), 4, secs, roof));
        }
    }
    Ok(points)
}
