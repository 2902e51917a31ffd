//! Speed on any device through the candle engine: target-only decode, a verification pass, the speculative loop with
//! an EAGLE-1 draft at each kept vocabulary, the LM head alone, and the device's own ceilings to compare them with.

use super::{median, median_secs, HeadPoint, Roofline};
use crate::engine::candle::draft::DraftWeights;
use crate::engine::candle::kernels::product;
use crate::engine::candle::HEAD_ROW_MULTIPLE;
use crate::engine::candle::llama::{argmax_rows, greedy, layer_parameters, streamed_parameters, Attention, Llama};
use crate::engine::cpu::model::{Config, Model};
use crate::sampling::Sampling;
use crate::speculative::decode::{speculative_turns, TurnJob, Turns};
use crate::speculative::{speculative_turn, DraftHead, DraftMode, HeadMode, SpecConfig};
use crate::vocab::KeepSet;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::time::Instant;

/// The device's ceilings as measured on it: its bandwidth and the best of five 8192³ products in `dtype` (on the
/// CPU, the CPU probes).
pub fn roofline(device: &Device, dtype: DType) -> Result<Roofline> {
    if device.is_cpu() {
        return super::roofline();
    }
    let n = 8192;
    let a = Tensor::ones((n, n), dtype, device)?;
    let mut best = f64::INFINITY;
    a.matmul(&a)?;
    device.synchronize()?;
    for _ in 0..5 {
        let t = Instant::now();
        std::hint::black_box(a.matmul(&a)?);
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(Roofline { bytes_per_sec: bandwidth(device)?, flops_per_sec: 2.0 * (n * n * n) as f64 / best })
}

/// Read bandwidth as measured on the device: the best of three read-only passes over 4 GiB of random values, row
/// sums (what PyTorch's `sum` probe does) and a bf16 matrix-vector product (what a decode step is made of) through
/// cuBLAS and through frspec's kernel; on the CPU, the CPU's read probe. An elementwise pass is not a read probe: it
/// also writes, and through candle it reached only 632–678 GB/s on an H200 where reads run at 4,220 GB/s.
pub fn bandwidth(device: &Device) -> Result<f64> {
    if device.is_cpu() {
        return Ok(super::read_bandwidth());
    }
    let (rows, cols) = (1usize << 16, 1usize << 14);
    let rowsums = {
        let x = Tensor::randn(0f32, 1.0, (rows, cols), device)?;
        read_rate(device, x.elem_count() * 4, || Ok(x.sum_keepdim(1)?))?
    };
    let (cublas, frspec) = {
        let w = Tensor::randn(0f32, 1.0, (2 * rows * cols / 4096, 4096), device)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (1, 4096), device)?.to_dtype(DType::BF16)?;
        (read_rate(device, w.elem_count() * 2, || Ok(v.matmul(&w.t()?)?))?, read_rate(device, w.elem_count() * 2, || product(&v, &w))?)
    };
    Ok(rowsums.max(cublas).max(frspec))
}

/// Bytes per second of `pass`, which reads `bytes` once, median of several runs.
fn read_rate(device: &Device, bytes: usize, mut pass: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let secs = median_secs(|| {
        std::hint::black_box(pass()?);
        Ok(device.synchronize()?)
    })?;
    Ok(bytes as f64 / secs)
}

/// `bench head` on a device: draft logits `[B, H] × [H, V′]` in `dtype` (weights and activations) as the engine
/// computes them (`DeviceHead`: the kept rows padded to a multiple of 128; one row through frspec's matrix-vector
/// kernel, more through candle's matmul), and through candle's matmul over exactly the kept rows for comparison.
/// Bytes count the rows read, useful FLOPs the kept rows.
pub fn head(hidden: usize, vocab: usize, batches: &[usize], ratios: &[f64], device: &Device, dtype: DType, roof: Roofline) -> Result<Vec<HeadPoint>> {
    let mut points = Vec::new();
    for &ratio in ratios {
        let kept = crate::vocab::kept_for_ratio(ratio, vocab);
        let stored = kept.next_multiple_of(HEAD_ROW_MULTIPLE);
        let padded = Tensor::randn(0f32, 0.02, (stored, hidden), device)?.to_dtype(dtype)?;
        let exact = padded.narrow(0, 0, kept)?.contiguous()?;
        for &b in batches {
            let x = Tensor::randn(0f32, 1.0, (b, hidden), device)?.to_dtype(dtype)?;
            let time = |f: &dyn Fn() -> Result<Tensor>| {
                median_secs(|| {
                    std::hint::black_box(f()?);
                    Ok(device.synchronize()?)
                })
            };
            let secs = time(&|| product(&x, &padded))?;
            let mut point = HeadPoint::new(ratio, kept, b, hidden, dtype.as_str(), stored * hidden * dtype.size_in_bytes(), dtype.size_in_bytes(), secs, roof);
            point.matmul_exact_secs = Some(time(&|| Ok(x.matmul(&exact.t()?)?))?);
            points.push(point);
        }
    }
    Ok(points)
}

/// What one drafting step and one speculative step cost at a kept vocabulary.
#[derive(Clone, Debug, Serialize)]
pub struct DraftCost {
    pub ratio: f64,
    pub kept: usize,
    /// Median over runs of the speculative loop's drafting seconds per draft token (fc, the layer, the kept LM-head
    /// rows, the token chosen on the host).
    pub draft_step_secs: f64,
    /// Median tokens/s of the speculative loop itself (prefill included) with this random head, which the target
    /// almost never accepts: about one token per step.
    pub loop_tok_s: f64,
    /// What one drafting step must read (fc, the layer, the kept head rows) at the measured bandwidth, and the
    /// step's share of that limit.
    pub draft_limit_secs: f64,
    pub draft_share: f64,
    /// One verification pass plus k drafting steps.
    pub speculative_step_secs: f64,
    /// The mean acceptance length at which speculative decoding matches target-only speed.
    pub break_even_length: f64,
    /// Tokens/s at each of the bench's acceptance lengths: length ÷ speculative step seconds.
    pub projected_tok_s: Vec<f64>,
}

/// Greedy tokens of the device model against the CPU engine's, from the same weights and prompt.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    pub engine: Vec<u32>,
    pub device: Vec<u32>,
    /// The first position where they differ, if any.
    pub first_difference: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceDecodeBench {
    pub device: String,
    pub dtype: String,
    /// Where the weights came from: a model path, or "random" for a named shape.
    pub weights: String,
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    /// Bytes of weights one decode step reads (layers, final norm, LM head).
    pub weight_bytes_per_token: f64,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub runs: usize,
    pub k: usize,
    /// Median tokens/s of greedy one-token steps after the prompt.
    pub decode_tok_s: f64,
    pub decode_tok_s_runs: Vec<f64>,
    pub prefill_tok_s: f64,
    /// Weight bytes one decode step reads ÷ its median time.
    pub decode_bytes_per_sec: f64,
    /// The device's measured bandwidth (`bandwidth`), and the decode's share of it.
    pub device_bytes_per_sec: f64,
    pub bandwidth_share: f64,
    /// Median seconds of a verification pass: k + 1 tokens forwarded, logits for all of them, argmax.
    pub verify_secs: f64,
    /// Verification passes of k + 1 and of 64 tokens against the weight-streaming limit.
    pub verify: Vec<BlockCost>,
    /// Weight bytes of one step ÷ the measured bandwidth: the fastest a step can be.
    pub step_limit_secs: f64,
    /// Median host seconds to enqueue one decode step (forward, logits, argmax on the device) and the step's seconds
    /// once the device has finished it: when the two are close, launching the kernels is what bounds a step.
    pub decode_enqueue_secs: f64,
    pub decode_synced_secs: f64,
    /// The same synced step with one-token attention through candle's products and softmax instead of the fused
    /// kernel.
    pub decode_products_synced_secs: f64,
    /// Seconds of one target-only decode step (1 / decode_tok_s).
    pub decode_step_secs: f64,
    pub acceptance_lengths: Vec<f64>,
    pub drafts: Vec<DraftCost>,
    pub batched: Vec<BatchedLoop>,
    pub agreement: Option<Agreement>,
}

/// A forward of a block of tokens against the weight-streaming limit.
#[derive(Clone, Debug, Serialize)]
pub struct BlockCost {
    pub tokens: usize,
    pub secs: f64,
    /// The step limit ÷ `secs`.
    pub share: f64,
}

pub struct DecodeSettings<'a> {
    /// As the user named it (cpu, cuda:0).
    pub device: &'a str,
    pub prompt: &'a [u32],
    pub new_tokens: usize,
    pub runs: usize,
    pub k: usize,
    pub ratios: &'a [f64],
    pub acceptance_lengths: &'a [f64],
    /// Sequences the batched speculative loop decodes together, one measurement each.
    pub batches: &'a [usize],
}

/// The speculative loop decoding several sequences together (ratio 0, argmax drafts, random head), at T = 0 or
/// T = 1: the sweep's sampled cells verify with the target's distributions (softmax of k + 1 vocabulary rows a
/// sequence and step, the drafts' probabilities, draws), where T = 0 takes the rows' argmax.
#[derive(Clone, Debug, Serialize)]
pub struct BatchedLoop {
    pub batch: usize,
    pub temperature: f64,
    /// Speculative steps per second, all sequences together (a step drafts k tokens and verifies k + 1 per sequence).
    pub steps_per_sec: f64,
    /// Tokens per second with this random head (about one a step).
    pub tok_s: f64,
    /// Minutes the `llama31-eagle` preset's sampled cells (6 ratios × 80 MT-Bench prompts × 5 repeats × 2 turns × 256
    /// tokens) take at these steps/s, at each of the bench's acceptance lengths: the T = 1 row is the estimate, the
    /// T = 0 row what it would be if sampling cost nothing.
    pub preset_minutes: Vec<f64>,
}

/// Tokens the `llama31-eagle` preset decodes speculatively with `--repeats 5`: its 6 ratios × MT-Bench's 80 prompts ×
/// 5 repeats × 2 turns × up to 256 new tokens at T = 1 (T = 0 runs once through the fast path).
const LLAMA31_PRESET_SAMPLED_TOKENS: f64 = 6.0 * 80.0 * 5.0 * 2.0 * 256.0;

/// Steps/s of the batched speculative loop with `batch` slots of a random EAGLE-1 head at `temperature`: `batch` turns
/// of up to `s.new_tokens` each, after one untimed round.
fn batched_loop(model: &Llama, eagle: &DraftWeights, s: &DecodeSettings, batch: usize, temperature: f64) -> Result<BatchedLoop> {
    /// The same prompt `left` more times (each turn after the first starts from the prompt's positions a slot holds,
    /// as a sweep's ratios and repeats of one prompt do); tokens and steps of the turns that finished.
    struct Repeated<'h> {
        left: usize,
        prompt: &'h [u32],
        head: &'h DraftHead<crate::engine::candle::DeviceHead>,
        tokens: usize,
        steps: u64,
    }
    impl<'h> Turns<'h, crate::engine::candle::DeviceHead> for Repeated<'h> {
        fn next(&mut self) -> Result<Option<TurnJob<'h, crate::engine::candle::DeviceHead>>> {
            if self.left == 0 {
                return Ok(None);
            }
            self.left -= 1;
            let rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(self.left as u64);
            Ok(Some(TurnJob { id: self.left, prompt: self.prompt.to_vec(), head: self.head, rng: Box::new(rng) }))
        }
        fn finished(&mut self, _: usize, tokens: Vec<u32>, record: crate::speculative::TurnRecord) -> Result<()> {
            self.tokens += tokens.len();
            self.steps += record.drafts;
            Ok(())
        }
    }
    let mut drafts: Vec<_> = (0..batch).map(|_| eagle.instance(model)).collect();
    let head = DraftHead::new(drafts[0].lm_head(), None, HeadMode::Slice)?;
    let cfg = SpecConfig { k: s.k, mode: DraftMode::Argmax, sampling: Sampling::new(temperature as f32, 1.0)?, max_new_tokens: s.new_tokens };
    let mut slots: Vec<&mut dyn crate::speculative::Draft<Llama>> = drafts.iter_mut().map(|d| d.as_mut() as _).collect();
    let mut timed = None;
    for _ in 0..2 {
        let mut turns = Repeated { left: batch, prompt: s.prompt, head: &head, tokens: 0, steps: 0 };
        let t = Instant::now();
        speculative_turns(model, &[], &mut slots, &cfg, &mut turns)?;
        timed = Some((turns, t.elapsed().as_secs_f64()));
    }
    let (turns, secs) = timed.expect("two rounds ran");
    let steps_per_sec = turns.steps as f64 / secs;
    Ok(BatchedLoop {
        batch,
        temperature,
        steps_per_sec,
        tok_s: turns.tokens as f64 / secs,
        preset_minutes: s.acceptance_lengths.iter().map(|l| LLAMA31_PRESET_SAMPLED_TOKENS / l / steps_per_sec / 60.0).collect(),
    })
}

/// Target-only decode speed and the cost of a speculative step at each ratio, timed in the speculative loop. Draft
/// weights are random (speed does not depend on them), so speculative speed is projected from the step cost at given
/// acceptance lengths.
pub fn decode(model: &Llama, weights: &str, s: &DecodeSettings, engine: Option<&Model>) -> Result<DeviceDecodeBench> {
    let device = &model.device;
    let (mut decode_runs, mut prefill_runs) = (Vec::new(), Vec::new());
    for run in 0..=s.runs {
        let t = Instant::now();
        let mut cache = model.new_cache();
        let mut next = model.greedy_next(s.prompt, &mut cache)?;
        let prefill = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..s.new_tokens {
            next = model.greedy_next(&[next], &mut cache)?;
        }
        let decode = t.elapsed().as_secs_f64();
        // The first run warms up kernels and allocations.
        if run > 0 {
            prefill_runs.push(s.prompt.len() as f64 / prefill);
            decode_runs.push(s.new_tokens as f64 / decode);
        }
    }
    let decode_tok_s = median(&decode_runs);
    let (decode_enqueue_secs, decode_synced_secs) = enqueue_and_step(model, s.prompt, s.new_tokens, Attention::Fused)?;
    let (_, decode_products_synced_secs) = enqueue_and_step(model, s.prompt, s.new_tokens, Attention::Products)?;

    let weight_bytes = (streamed_parameters(&model.config) * model.dtype.size_in_bytes()) as f64;
    let device_bytes_per_sec = bandwidth(device)?;
    let step_limit_secs = weight_bytes / device_bytes_per_sec;

    let mut cache = model.new_cache();
    model.forward(s.prompt, &mut cache)?;
    let base = cache.len();
    let mut blocks = vec![s.k + 1, 64];
    blocks.dedup();
    let verify = blocks
        .into_iter()
        .map(|tokens| -> Result<BlockCost> {
            let block: Vec<u32> = s.prompt.iter().cycle().take(tokens).copied().collect();
            let secs = median_secs(|| {
                argmax_rows(&model.logits(&model.forward(&block, &mut cache)?)?)?;
                cache.truncate(base);
                Ok(())
            })?;
            Ok(BlockCost { tokens, secs, share: step_limit_secs / secs })
        })
        .collect::<Result<Vec<_>>>()?;
    let verify_secs = verify[0].secs;

    let decode_step_secs = 1.0 / decode_tok_s;
    let eagle = DraftWeights::random_eagle(model)?;
    let vocab = model.config.vocab;
    let cfg = SpecConfig { k: s.k, mode: DraftMode::Argmax, sampling: Sampling::GREEDY, max_new_tokens: s.new_tokens };
    let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(0);
    let mut drafts = Vec::new();
    for &ratio in s.ratios {
        let kept = crate::vocab::kept_for_ratio(ratio, vocab);
        let mut draft = eagle.instance(model);
        let keep = (kept < vocab).then(|| KeepSet { ids: (0..kept as u32).collect(), vocab });
        let head = DraftHead::new(draft.lm_head(), keep, HeadMode::Slice)?;
        let (mut per_draft, mut loop_runs) = (Vec::new(), Vec::new());
        for run in 0..=s.runs {
            let t = Instant::now();
            let (tokens, rec) = speculative_turn(model, &[], draft.as_mut(), &head, s.prompt, &cfg, &mut rng)?;
            let wall = t.elapsed().as_secs_f64();
            if run > 0 {
                per_draft.push(rec.draft_secs / rec.draft_tokens.max(1) as f64);
                loop_runs.push(tokens.len() as f64 / wall);
            }
        }
        let draft_step_secs = median(&per_draft);
        let speculative_step_secs = verify_secs + s.k as f64 * draft_step_secs;
        let c = &model.config;
        let draft_bytes = ((2 * c.hidden * c.hidden + layer_parameters(c) + kept * c.hidden) * model.dtype.size_in_bytes()) as f64;
        let draft_limit_secs = draft_bytes / device_bytes_per_sec;
        drafts.push(DraftCost {
            ratio,
            kept,
            draft_step_secs,
            draft_limit_secs,
            draft_share: draft_limit_secs / draft_step_secs,
            loop_tok_s: median(&loop_runs),
            speculative_step_secs,
            break_even_length: speculative_step_secs / decode_step_secs,
            projected_tok_s: s.acceptance_lengths.iter().map(|l| l / speculative_step_secs).collect(),
        });
    }

    let batched = [0.0, 1.0].iter().flat_map(|&t| s.batches.iter().map(move |&b| (b, t))).map(|(b, t)| batched_loop(model, &eagle, s, b, t)).collect::<Result<Vec<_>>>()?;

    let agreement = engine
        .map(|m| -> Result<Agreement> {
            let engine = super::engine_greedy(m, s.prompt, s.new_tokens)?;
            let on_device = greedy(model, s.prompt, s.new_tokens)?;
            let first_difference = engine.iter().zip(&on_device).position(|(a, b)| a != b);
            Ok(Agreement { engine, device: on_device, first_difference })
        })
        .transpose()
        .context("comparing greedy tokens with the CPU engine")?;

    let decode_bytes_per_sec = weight_bytes * decode_tok_s;
    Ok(DeviceDecodeBench {
        device: s.device.into(),
        dtype: model.dtype.as_str().into(),
        weights: weights.into(),
        hidden: model.config.hidden,
        layers: model.config.layers,
        vocab: model.config.vocab,
        weight_bytes_per_token: weight_bytes,
        prompt_tokens: s.prompt.len(),
        new_tokens: s.new_tokens,
        runs: s.runs,
        k: s.k,
        decode_tok_s,
        decode_tok_s_runs: decode_runs,
        prefill_tok_s: median(&prefill_runs),
        decode_bytes_per_sec,
        device_bytes_per_sec,
        bandwidth_share: decode_bytes_per_sec / device_bytes_per_sec,
        verify_secs,
        verify,
        step_limit_secs,
        decode_enqueue_secs,
        decode_synced_secs,
        decode_products_synced_secs,
        decode_step_secs,
        acceptance_lengths: s.acceptance_lengths.to_vec(),
        drafts,
        batched,
        agreement,
    })
}

/// Medians over `steps` one-token steps after `prompt` of the host time to enqueue a step and of the step's time
/// until the device is done with it (the next token fixed, so nothing is read back).
fn enqueue_and_step(model: &Llama, prompt: &[u32], steps: usize, attention: Attention) -> Result<(f64, f64)> {
    let mut cache = model.new_cache().attending(attention);
    model.forward(prompt, &mut cache)?;
    let (mut enqueue, mut synced) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        model.device.synchronize()?;
        let t = Instant::now();
        let hidden = model.forward(&prompt[..1], &mut cache)?;
        std::hint::black_box(model.logits(&hidden)?.argmax(candle_core::D::Minus1)?);
        enqueue.push(t.elapsed().as_secs_f64());
        model.device.synchronize()?;
        synced.push(t.elapsed().as_secs_f64());
    }
    Ok((median(&enqueue), median(&synced)))
}

/// A prompt of `n` token ids spread over the vocabulary, for models without a tokenizer.
pub fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// A model's dimensions, for printing.
pub fn describe(c: &Config) -> String {
    format!("H {} × {} layers, {} heads ({} KV), V {}", c.hidden, c.layers, c.heads, c.kv_heads, c.vocab)
}
