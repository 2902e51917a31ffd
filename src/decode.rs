//! The speculative loop: draft k tokens, verify them in one target forward over k+1 positions, accept or reject
//! (rejection sampling), emit the recovered or bonus token, roll both caches back to the accepted prefix.
//! Counters follow vLLM's definitions (../shared/reference/NOTES.md) so numbers compare with the literature.

use crate::draft::{Context, Draft, DraftHead, DraftMode, Proposal};
use crate::generate::StopReason;
use crate::model::Model;
use crate::sampling::{draw, Sampling};
use crate::stats::Metric;
use anyhow::{bail, Result};
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
pub struct SpecConfig {
    /// Draft tokens per step.
    pub k: usize,
    pub mode: DraftMode,
    pub sampling: Sampling,
    pub max_new_tokens: usize,
}

/// What one turn of speculative decoding did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct TurnRecord {
    pub prompt_tokens: usize,
    pub generated: usize,
    /// Steps that had drafts.
    pub drafts: u64,
    /// Draft tokens verified (drafts after an accepted end-of-turn token are discarded unverified).
    pub draft_tokens: u64,
    /// Accepted draft tokens (the recovered or bonus token is not counted).
    pub accepted: u64,
    /// `accepted_per_pos[i]`: steps that accepted at least i + 1 drafts.
    pub accepted_per_pos: Vec<u64>,
    /// Σ over steps of Σ_j Π_{i≤j} α_i, α_i = min(1, p_i(x_i)/q_i(x_i)): the expected accepted count given the
    /// drafts, a lower-variance estimate of `accepted` read off the verification pass.
    pub expected_accepted: f64,
    pub stop: Option<StopReason>,
    pub draft_secs: f64,
    pub target_secs: f64,
}

impl TurnRecord {
    /// vLLM's mean acceptance length: 1 + accepted / drafts (1.0 without drafts).
    pub fn mean_acceptance_length(&self) -> f64 {
        Metric::MeanAcceptanceLength.of(&self.into())
    }

    /// vLLM's acceptance rate in %: 100 · accepted / draft tokens.
    pub fn acceptance_rate(&self) -> f64 {
        Metric::AcceptanceRate.of(&self.into())
    }

    /// Count one drafting step: `verified` drafts checked, the first `accepted` of them kept.
    fn count_step(&mut self, verified: usize, accepted: usize, expected_accepted: f64) {
        self.drafts += 1;
        self.draft_tokens += verified as u64;
        self.accepted += accepted as u64;
        self.expected_accepted += expected_accepted;
        self.accepted_per_pos.iter_mut().take(accepted).for_each(|c| *c += 1);
    }

    /// Timings vary from run to run; everything else must not.
    pub fn without_timings(&self) -> TurnRecord {
        TurnRecord { draft_secs: 0.0, target_secs: 0.0, ..self.clone() }
    }
}

/// Drafts a step may propose: at most k, leaving room for the recovered or bonus token within the remaining
/// new tokens and the context (`room` positions left after the pending token).
fn drafts_allowed(k: usize, remaining: usize, room: usize) -> usize {
    k.min(remaining - 1).min(room.saturating_sub(1))
}

/// How many drafts verification looks at: drafts after a stop token would continue a finished turn, so it ends at
/// the first one (inclusive). Drafts beyond are discarded unverified and not counted.
fn verification_limit(drafts: &[u32], stop_ids: &[u32]) -> usize {
    drafts.iter().position(|t| stop_ids.contains(t)).map_or(drafts.len(), |p| p + 1)
}

/// Buffers the loop reuses between steps and turns.
#[derive(Default)]
struct Scratch {
    p: Vec<f32>,
    residual: Vec<f32>,
    order: Vec<u32>,
    proposal: Proposal,
}

/// Generate one turn after `prompt`, speculatively. Returns the generated ids (ending with the stop token when
/// that ended the turn) and the record. Every random draw comes from `rng`.
pub fn speculative_turn(
    target: &Model,
    stop_ids: &[u32],
    draft: &mut dyn Draft,
    head: &DraftHead,
    prompt: &[u32],
    cfg: &SpecConfig,
    rng: &mut dyn rand::Rng,
) -> Result<(Vec<u32>, TurnRecord)> {
    if cfg.k == 0 {
        bail!("k (draft tokens per step) must be at least 1");
    }
    if prompt.is_empty() {
        bail!("empty prompt");
    }
    if head.vocab() != target.config.vocab {
        bail!("the draft head has {} rows, the target vocabulary is {}", head.vocab(), target.config.vocab);
    }
    let (v, h, ctx_limit) = (target.config.vocab, target.config.hidden, target.config.context_length);
    let mut s = Scratch::default();
    let mut rec = TurnRecord { prompt_tokens: prompt.len(), accepted_per_pos: vec![0; cfg.k], ..TurnRecord::default() };
    draft.reset();
    let mut cache = target.new_cache();
    let t0 = Instant::now();
    let layers = draft.target_layers();
    let prefill = target.forward(prompt, &mut cache, &[prompt.len() - 1], &layers)?;
    let mut features = prefill.hidden;
    let mut layer_features = Vec::new();
    interleave(&prefill.layer_inputs, h, &mut layer_features);
    cfg.sampling.distribution(&prefill.logits, &mut s.p, &mut s.order);
    let first = draw(&s.p, rng);
    rec.target_secs += t0.elapsed().as_secs_f64();
    let mut tokens = prompt.to_vec();
    tokens.push(first);
    let stopped = |t: u32| stop_ids.contains(&t);
    if stopped(first) {
        rec.stop = Some(StopReason::EndOfTurn);
    }

    while rec.stop.is_none() {
        let generated = tokens.len() - prompt.len();
        let remaining = cfg.max_new_tokens.saturating_sub(generated);
        if remaining == 0 {
            rec.stop = Some(StopReason::MaxTokens);
            break;
        }
        // One step emits up to k + 1 tokens and needs k + 1 more positions in the target's context.
        let room = ctx_limit.saturating_sub(cache.len() + 1);
        if room == 0 {
            rec.stop = Some(StopReason::ContextLimit);
            break;
        }
        let k = drafts_allowed(cfg.k, remaining, room);
        let n = tokens.len();
        let last = tokens[n - 1];
        let mut block = vec![last];
        if k > 0 {
            let t = Instant::now();
            let ctx = Context { tokens: &tokens, features: &features, layer_features: &layer_features };
            draft.propose(&ctx, k, head, cfg.mode, cfg.sampling, rng, &mut s.proposal)?;
            rec.draft_secs += t.elapsed().as_secs_f64();
            block.extend_from_slice(&s.proposal.tokens);
        }

        let t = Instant::now();
        let rows: Vec<usize> = (0..=k).collect();
        let verify = target.forward(&block, &mut cache, &rows, &layers)?;
        features.extend_from_slice(&verify.hidden);
        interleave(&verify.layer_inputs, h, &mut layer_features);
        let limit = verification_limit(&s.proposal.tokens[..k], stop_ids);
        let mut accepted = 0;
        let mut next = None;
        let mut survive = 1.0f64;
        let mut expected = 0.0f64;
        for i in 0..limit {
            cfg.sampling.distribution(&verify.logits[i * v..(i + 1) * v], &mut s.p, &mut s.order);
            let x = s.proposal.tokens[i];
            let alpha = (s.p[x as usize] as f64 / s.proposal.q_token[i] as f64).min(1.0);
            survive *= alpha;
            expected += survive;
            if next.is_some() {
                continue;
            }
            let u: f64 = rng.random();
            if u < alpha {
                accepted += 1;
            } else {
                next = Some(recover(&s.p, &s.proposal, i, head, &mut s.residual, rng));
            }
        }
        let ended_on_draft = next.is_none() && accepted > 0 && stopped(s.proposal.tokens[accepted - 1]);
        let next = match next {
            Some(t) => Some(t),
            None if ended_on_draft => None,
            None => {
                cfg.sampling.distribution(&verify.logits[k * v..(k + 1) * v], &mut s.p, &mut s.order);
                Some(draw(&s.p, rng))
            }
        };
        rec.target_secs += t.elapsed().as_secs_f64();
        if k > 0 {
            rec.count_step(limit, accepted, expected);
        }

        // Keep the target's positions up to the last accepted draft; the new token is fed next step.
        cache.truncate(n + accepted);
        features.truncate((n + accepted) * h);
        layer_features.truncate((n + accepted) * h * layers.len());
        draft.rollback(n, accepted);
        for &t in s.proposal.tokens[..accepted].iter().chain(next.iter()) {
            tokens.push(t);
            if stopped(t) {
                rec.stop = Some(StopReason::EndOfTurn);
                break;
            }
        }
    }
    let generated = tokens[prompt.len()..].to_vec();
    rec.generated = generated.len();
    Ok((generated, rec))
}

/// Append, position by position, the concatenation of each captured layer's row (`[n, hidden]` each).
pub(crate) fn interleave(per_layer: &[Vec<f32>], hidden: usize, out: &mut Vec<f32>) {
    let Some(first) = per_layer.first() else { return };
    for i in 0..first.len() / hidden {
        for layer in per_layer {
            out.extend_from_slice(&layer[i * hidden..(i + 1) * hidden]);
        }
    }
}

/// The token emitted when draft i is rejected: a draw from norm(max(0, p − q_i)).
fn recover(p: &[f32], proposal: &Proposal, i: usize, head: &DraftHead, residual: &mut Vec<f32>, rng: &mut dyn rand::Rng) -> u32 {
    residual.clear();
    residual.extend_from_slice(p);
    match proposal.q.get(i).filter(|q| !q.is_empty()) {
        // q over head space: subtract it at the ids it covers.
        Some(q) => {
            for (index, qv) in q.iter().enumerate() {
                if *qv > 0.0 {
                    let id = head.id(index) as usize;
                    residual[id] = (residual[id] - qv).max(0.0);
                }
            }
        }
        // A point mass on the draft token.
        None => {
            let x = proposal.tokens[i] as usize;
            residual[x] = (residual[x] - 1.0).max(0.0);
        }
    }
    let total: f64 = residual.iter().map(|r| *r as f64).sum();
    if total <= 0.0 {
        // p ≤ q everywhere means p = q: rejection had probability zero; fall back to p itself.
        return draw(p, rng);
    }
    let inv = (1.0 / total) as f32;
    residual.iter_mut().for_each(|r| *r *= inv);
    draw(residual, rng)
}

/// The target's greedy continuation of a prompt with the features drafts read.
pub struct Continuation {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Post-norm hidden states of every token but the last (which was never fed): `[tokens.len() - 1, hidden]`.
    pub features: Vec<f32>,
    /// For each requested layer, its input at the same positions.
    pub captured: Vec<Vec<f32>>,
    pub stop: StopReason,
    pub secs: f64,
}

/// `new_tokens` greedy tokens after `prompt`, with no stop token: `next` forwards the tokens it is given on top of
/// what it has seen (first the prompt, then each new token) and returns the argmax after the last.
pub fn greedy_steps(prompt: &[u32], new_tokens: usize, mut next: impl FnMut(&[u32]) -> Result<u32>) -> Result<Vec<u32>> {
    let mut out = vec![next(prompt)?];
    while out.len() < new_tokens {
        let last = out[out.len() - 1];
        out.push(next(&[last])?);
    }
    out.truncate(new_tokens);
    Ok(out)
}

/// Generate greedily one token at a time after `prompt`, keeping every position's features and the inputs of
/// `layers`.
pub fn greedy_continuation(target: &Model, stop_ids: &[u32], prompt: &[u32], max_new_tokens: usize, layers: &[usize]) -> Result<Continuation> {
    Ok(greedy_continuations(target, stop_ids, &[prompt], max_new_tokens, layers)?.remove(0))
}

/// Greedy continuations of several prompts decoded together: each prompt is prefilled alone, then each step
/// forwards the newest token of every unfinished sequence as one block (`Model::forward_batch`), so a step's pass
/// over the weights serves them all. Each continuation is what the prompt gets alone, bit for bit; `secs` is the
/// call's wall time shared equally.
pub fn greedy_continuations<P: AsRef<[u32]>>(target: &Model, stop_ids: &[u32], prompts: &[P], max_new_tokens: usize, layers: &[usize]) -> Result<Vec<Continuation>> {
    continuations(target, stop_ids, prompts, max_new_tokens, layers, &mut |_, logits| crate::sampling::argmax(logits))
}

/// Continuations decoded together as `greedy_continuations` does, each next token chosen by `choose(sequence,
/// logits)`: with a random stream per sequence, a sampled continuation does not depend on what else is in the batch.
pub fn continuations<P: AsRef<[u32]>>(
    target: &Model,
    stop_ids: &[u32],
    prompts: &[P],
    max_new_tokens: usize,
    layers: &[usize],
    choose: &mut dyn FnMut(usize, &[f32]) -> u32,
) -> Result<Vec<Continuation>> {
    let prompts: Vec<&[u32]> = prompts.iter().map(|p| p.as_ref()).collect();
    if prompts.iter().any(|p| p.is_empty()) {
        bail!("empty prompt");
    }
    let t0 = Instant::now();
    let ctx_limit = target.config.context_length;
    let mut seqs = Vec::with_capacity(prompts.len());
    let mut caches = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.iter().enumerate() {
        let mut cache = target.new_cache();
        let fwd = target.forward(prompt, &mut cache, &[prompt.len() - 1], layers)?;
        let next = choose(i, &fwd.logits);
        seqs.push((Continuation { tokens: prompt.to_vec(), features: fwd.hidden, captured: fwd.layer_inputs, stop: StopReason::MaxTokens, secs: 0.0 }, next));
        caches.push(cache);
    }
    let (h, mut active): (usize, Vec<usize>) = (target.config.hidden, (0..prompts.len()).collect());
    let mut tokens = Vec::with_capacity(prompts.len());
    while !active.is_empty() {
        // Take each sequence's next token; those that stop leave the batch.
        active.retain(|&i| {
            let (c, next) = &mut seqs[i];
            c.tokens.push(*next);
            let stop = if stop_ids.contains(next) {
                Some(StopReason::EndOfTurn)
            } else if c.tokens.len() - prompts[i].len() == max_new_tokens {
                Some(StopReason::MaxTokens)
            } else if caches[i].len() + 1 >= ctx_limit {
                Some(StopReason::ContextLimit)
            } else {
                None
            };
            c.stop = stop.unwrap_or(c.stop);
            stop.is_none()
        });
        if active.is_empty() {
            break;
        }
        tokens.clear();
        tokens.extend(active.iter().map(|&i| seqs[i].1));
        let mut batch: Vec<&mut crate::model::Cache> = caches.iter_mut().enumerate().filter(|(i, _)| active.binary_search(i).is_ok()).map(|(_, c)| c).collect();
        let fwd = target.forward_batch(&tokens, &mut batch, layers)?;
        for (row, &i) in active.iter().enumerate() {
            let (c, next) = &mut seqs[i];
            c.features.extend_from_slice(&fwd.hidden[row * h..(row + 1) * h]);
            c.captured.iter_mut().zip(&fwd.layer_inputs).for_each(|(c, l)| c.extend_from_slice(&l[row * h..(row + 1) * h]));
            *next = choose(i, &fwd.logits[row * target.config.vocab..(row + 1) * target.config.vocab]);
        }
    }
    let secs = t0.elapsed().as_secs_f64() / prompts.len() as f64;
    Ok(seqs.into_iter().map(|(c, _)| Continuation { secs, ..c }).collect())
}

/// Greedy (T = 0) speculative decoding for several drafts at once. Greedy output does not depend on the draft,
/// so the target's continuation is generated once, and each draft is run along it: a draft token is accepted
/// while it matches the continuation, and the next token is the continuation's. The target features the drafts
/// read come from that one pass, bit-identical to what verification blocks compute, so each record equals the
/// full loop's (tested); only `target_secs`, the shared pass, is the same for every draft.
pub fn greedy_turns(
    target: &Model,
    stop_ids: &[u32],
    drafts: &mut [(&mut dyn Draft, &DraftHead)],
    prompt: &[u32],
    k: usize,
    max_new_tokens: usize,
) -> Result<(Vec<u32>, Vec<TurnRecord>)> {
    if k == 0 {
        bail!("k (draft tokens per step) must be at least 1");
    }
    let (h, ctx_limit) = (target.config.hidden, target.config.context_length);
    let layers: Vec<usize> = {
        let mut all: Vec<usize> = drafts.iter().flat_map(|(d, _)| d.target_layers()).collect();
        all.sort_unstable();
        all.dedup();
        all
    };
    let Continuation { tokens, features, captured, stop, secs: target_secs } = greedy_continuation(target, stop_ids, prompt, max_new_tokens, &layers)?;
    let stop = Some(stop);

    let mut records = Vec::with_capacity(drafts.len());
    let mut proposal = Proposal::default();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(0);
    for (draft, head) in drafts.iter_mut() {
        // This draft's auxiliary features, in the order it asked for them.
        let own: Vec<Vec<f32>> = draft.target_layers().iter().map(|l| captured[layers.binary_search(l).expect("captured")].clone()).collect();
        let mut layer_features = Vec::new();
        interleave(&own, h, &mut layer_features);
        let width = own.len() * h;
        let mut rec = TurnRecord { prompt_tokens: prompt.len(), accepted_per_pos: vec![0; k], target_secs, ..TurnRecord::default() };
        draft.reset();
        // Replay the full loop's steps along the continuation: n tokens known, the last not yet verified.
        let mut n = prompt.len() + 1;
        while n < tokens.len() {
            let remaining = max_new_tokens - (n - prompt.len());
            let k_used = drafts_allowed(k, remaining, ctx_limit.saturating_sub(n));
            let mut accepted = 0;
            if k_used > 0 {
                let ctx = Context {
                    tokens: &tokens[..n],
                    features: &features[..(n - 1) * h],
                    layer_features: &layer_features[..(n - 1) * width],
                };
                let t = Instant::now();
                draft.propose(&ctx, k_used, head, DraftMode::Argmax, Sampling::GREEDY, &mut rng, &mut proposal)?;
                rec.draft_secs += t.elapsed().as_secs_f64();
                accepted = proposal.tokens.iter().zip(&tokens[n..]).take_while(|(d, t)| d == t).count();
                // At T = 0 every α is 0 or 1, so the expected accepted count is the accepted count.
                rec.count_step(verification_limit(&proposal.tokens, stop_ids), accepted, accepted as f64);
            }
            draft.rollback(n, accepted);
            n += accepted + 1;
        }
        rec.generated = tokens.len() - prompt.len();
        rec.stop = stop;
        records.push(rec);
    }
    Ok((tokens[prompt.len()..].to_vec(), records))
}
