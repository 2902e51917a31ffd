//! Target-only decoding: the baseline every speculative run must reproduce.

use super::{Positions, TargetModel};
use crate::sampling::{argmax, draw, Sampling};
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndOfTurn,
    MaxTokens,
    ContextLimit,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_tokens: usize,
    /// Generated ids, the end-of-turn token included when that is why decoding stopped.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// Decode up to `max_new` tokens after `prompt` until one of `stop_ids`, drawing every sample from `rng`.
pub fn generate<T: TargetModel>(
    model: &T,
    stop_ids: &[u32],
    prompt: &[u32],
    max_new: usize,
    sampling: Sampling,
    rng: &mut impl rand::Rng,
) -> Result<Generation> {
    if prompt.is_empty() {
        anyhow::bail!("empty prompt");
    }
    let mut cache = model.new_cache();
    let started = Instant::now();
    let mut logits = Vec::new();
    model.forward(prompt, &mut cache, &[prompt.len() - 1], None, &mut logits)?;
    let prefill_secs = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let (mut probs, mut order) = (Vec::new(), Vec::new());
    let mut tokens = Vec::with_capacity(max_new);
    let stop = loop {
        if tokens.len() == max_new {
            break StopReason::MaxTokens;
        }
        if cache.len() + 1 > model.context_length() {
            break StopReason::ContextLimit;
        }
        let next = if sampling.is_greedy() {
            argmax(&logits)
        } else {
            sampling.distribution(&logits, &mut probs, &mut order);
            draw(&probs, rng)
        };
        tokens.push(next);
        if stop_ids.contains(&next) {
            break StopReason::EndOfTurn;
        }
        if tokens.len() < max_new {
            model.forward(&[next], &mut cache, &[0], None, &mut logits)?;
        }
    };
    Ok(Generation { prompt_tokens: prompt.len(), tokens, stop, prefill_secs, decode_secs: started.elapsed().as_secs_f64() })
}
