//! Teacher-forced scoring along a fixed token sequence: the tool for comparing numerics with other
//! implementations position by position (texts diverge at near-ties; logits along one sequence do not).

use crate::engine::cpu::model::Model;
use crate::sampling::{argmax, log_prob};
use anyhow::{bail, Result};
use serde::Serialize;

#[derive(Serialize)]
pub struct PositionScore {
    pub pos: usize,
    pub next_token: u32,
    pub logprob: f64,
    pub top1: u32,
}

#[derive(Serialize)]
pub struct Score {
    pub positions: Vec<PositionScore>,
    pub perplexity: f64,
    /// `[n, vocab]` logits at every position (position i predicts token i + 1).
    #[serde(skip)]
    pub logits: Vec<f32>,
}

/// Run `tokens` through the model as one block and score each next token.
pub fn score(model: &Model, tokens: &[u32]) -> Result<Score> {
    if tokens.len() < 2 {
        bail!("scoring needs at least 2 tokens, got {}", tokens.len());
    }
    let mut cache = model.new_cache();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let logits = model.forward(tokens, &mut cache, &rows, &[])?.logits;
    let v = model.config.vocab;
    let positions: Vec<PositionScore> = (0..tokens.len() - 1)
        .map(|i| {
            let row = &logits[i * v..(i + 1) * v];
            PositionScore { pos: i, next_token: tokens[i + 1], logprob: log_prob(row, tokens[i + 1]), top1: argmax(row) }
        })
        .collect();
    let mean_nll = -positions.iter().map(|p| p.logprob).sum::<f64>() / positions.len() as f64;
    Ok(Score { positions, perplexity: mean_nll.exp(), logits })
}
