//! Speed measurements, reported as medians over repeated runs (never asserted in tests).

use crate::chat::Message;
use crate::model::Model;
use crate::sampling::argmax;
use crate::target::Target;
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;

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
    pub decode_tok_s_runs: Vec<f64>,
    pub prefill_tok_s_runs: Vec<f64>,
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
pub fn decode(target: &Target, question: &str, new_tokens: usize, runs: usize, block: usize) -> Result<DecodeBench> {
    let prompt = target.tokenizer.chat_prompt(&[Message::new("user", question)])?;
    let model = &target.model;
    let (mut decode_runs, mut prefill_runs) = (Vec::new(), Vec::new());
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
        if run > 0 {
            prefill_runs.push(prompt.len() as f64 / prefill);
            decode_runs.push(new_tokens as f64 / decode);
        }
    }
    let block_cost_ratio = block_cost(model, &prompt, block, runs.max(5) * 4)?;
    Ok(DecodeBench {
        prompt_tokens: prompt.len(),
        new_tokens,
        runs,
        threads: rayon::current_num_threads(),
        decode_tok_s: median(&decode_runs),
        prefill_tok_s: median(&prefill_runs),
        block,
        block_cost_ratio,
        decode_tok_s_runs: decode_runs,
        prefill_tok_s_runs: prefill_runs,
    })
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
