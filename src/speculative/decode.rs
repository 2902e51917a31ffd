//! The speculative loop: draft k tokens, verify them in one target forward over k+1 positions, accept or reject
//! (rejection sampling), emit the recovered or bonus token, roll both caches back to the accepted prefix.
//! Counters follow vLLM's definitions (../shared/reference/NOTES.md) so numbers compare with the literature.

use super::draft::{Context, Draft, DraftHead, DraftMode, Proposal};
use super::generate::StopReason;
use super::{HeadRows, Positions, TargetModel};
use crate::sampling::{draw, Sampling};
use crate::stats::{Counts, Metric};
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

/// A record's counters as the statistics pool them (the statistics know nothing of decoding).
impl From<&TurnRecord> for Counts {
    fn from(r: &TurnRecord) -> Counts {
        Counts {
            drafts: r.drafts,
            draft_tokens: r.draft_tokens,
            accepted: r.accepted,
            expected_accepted: r.expected_accepted,
            accepted_per_pos: r.accepted_per_pos.clone(),
        }
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
    logits: Vec<f32>,
    block: Vec<u32>,
    p: Vec<f32>,
    residual: Vec<f32>,
    order: Vec<u32>,
    proposal: Proposal,
}

/// Generate one turn after `prompt`, speculatively. Returns the generated ids (ending with the stop token when
/// that ended the turn) and the record. Every random draw comes from `rng`.
pub fn speculative_turn<T: TargetModel>(
    target: &T,
    stop_ids: &[u32],
    draft: &mut dyn Draft<T>,
    head: &DraftHead<T::Head>,
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
    if head.vocab() != target.vocab() {
        bail!("the draft head has {} rows, the target vocabulary is {}", head.vocab(), target.vocab());
    }
    let (v, ctx_limit) = (target.vocab(), target.context_length());
    let mut s = Scratch::default();
    let mut rec = TurnRecord { prompt_tokens: prompt.len(), accepted_per_pos: vec![0; cfg.k], ..TurnRecord::default() };
    draft.reset();
    let mut cache = target.new_cache();
    let mut features = target.new_features(&draft.target_layers());
    let block_rows: Vec<usize> = (0..=cfg.k).collect();
    let t0 = Instant::now();
    target.forward(prompt, &mut cache, &[prompt.len() - 1], Some(&mut features), &mut s.logits)?;
    cfg.sampling.distribution(&s.logits, &mut s.p, &mut s.order);
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
        s.block.clear();
        s.block.push(tokens[n - 1]);
        s.proposal.tokens.clear();
        if k > 0 {
            let t = Instant::now();
            let ctx = Context { tokens: &tokens, features: &features };
            draft.propose(&ctx, k, head, cfg.mode, cfg.sampling, rng, &mut s.proposal)?;
            rec.draft_secs += t.elapsed().as_secs_f64();
            s.block.extend_from_slice(&s.proposal.tokens);
        }

        let t = Instant::now();
        target.forward(&s.block, &mut cache, &block_rows[..=k], Some(&mut features), &mut s.logits)?;
        let limit = verification_limit(&s.proposal.tokens[..k], stop_ids);
        let mut accepted = 0;
        let mut next = None;
        let mut survive = 1.0f64;
        let mut expected = 0.0f64;
        for i in 0..limit {
            cfg.sampling.distribution(&s.logits[i * v..(i + 1) * v], &mut s.p, &mut s.order);
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
                cfg.sampling.distribution(&s.logits[k * v..(k + 1) * v], &mut s.p, &mut s.order);
                Some(draw(&s.p, rng))
            }
        };
        rec.target_secs += t.elapsed().as_secs_f64();
        if k > 0 {
            rec.count_step(limit, accepted, expected);
        }

        // Keep the target's positions up to the last accepted draft; the new token is fed next step.
        cache.truncate(n + accepted)?;
        features.truncate(n + accepted)?;
        draft.rollback(n, accepted)?;
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

/// The token emitted when draft i is rejected: a draw from norm(max(0, p − q_i)).
fn recover<M: HeadRows>(p: &[f32], proposal: &Proposal, i: usize, head: &DraftHead<M>, residual: &mut Vec<f32>, rng: &mut dyn rand::Rng) -> u32 {
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

/// The target's greedy continuation of `prompt`, one token a forward, with the features drafts read: every token
/// but the last (never fed) has its row, and the layers asked for are captured.
pub struct Continuation<F> {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    pub features: F,
    pub stop: StopReason,
    pub secs: f64,
}

pub fn greedy_continuation<T: TargetModel>(target: &T, stop_ids: &[u32], prompt: &[u32], max_new_tokens: usize, layers: &[usize]) -> Result<Continuation<T::Features>> {
    if prompt.is_empty() {
        bail!("empty prompt");
    }
    let t0 = Instant::now();
    let mut cache = target.new_cache();
    let mut features = target.new_features(layers);
    let mut logits = Vec::new();
    target.forward(prompt, &mut cache, &[prompt.len() - 1], Some(&mut features), &mut logits)?;
    let mut tokens = prompt.to_vec();
    let stop = loop {
        let next = crate::sampling::argmax(&logits);
        tokens.push(next);
        if let Some(stop) = continuation_stop(next, stop_ids, tokens.len() - prompt.len(), max_new_tokens, cache.len(), target.context_length()) {
            break stop;
        }
        target.forward(&[next], &mut cache, &[0], Some(&mut features), &mut logits)?;
    };
    Ok(Continuation { tokens, features, stop, secs: t0.elapsed().as_secs_f64() })
}

/// Why a continuation ends after emitting `next` as its `generated`-th token, with `cached` positions in the target's
/// cache (the new token not yet fed); None to go on.
pub fn continuation_stop(next: u32, stop_ids: &[u32], generated: usize, max_new_tokens: usize, cached: usize, context_length: usize) -> Option<StopReason> {
    if stop_ids.contains(&next) {
        Some(StopReason::EndOfTurn)
    } else if generated == max_new_tokens {
        Some(StopReason::MaxTokens)
    } else if cached + 1 >= context_length {
        Some(StopReason::ContextLimit)
    } else {
        None
    }
}

/// Greedy (T = 0) speculative decoding for several drafts at once. Greedy output does not depend on the draft,
/// so the target's continuation is generated once, and each draft is run along it: a draft token is accepted
/// while it matches the continuation, and the next token is the continuation's. The target features the drafts
/// read come from that one pass; where the engine's blocks are bit-identical to single steps (the CPU engine)
/// each record equals the full loop's (tested); only `target_secs`, the shared pass, is the same for every draft.
/// The drafts read the same target layers (one captured set serves them all).
pub fn greedy_turns<T: TargetModel>(
    target: &T,
    stop_ids: &[u32],
    drafts: &mut [(&mut dyn Draft<T>, &DraftHead<T::Head>)],
    prompt: &[u32],
    k: usize,
    max_new_tokens: usize,
) -> Result<(Vec<u32>, Vec<TurnRecord>)> {
    if k == 0 {
        bail!("k (draft tokens per step) must be at least 1");
    }
    let ctx_limit = target.context_length();
    let layers = drafts.first().map(|(d, _)| d.target_layers()).unwrap_or_default();
    if let Some((d, _)) = drafts.iter().find(|(d, _)| d.target_layers() != layers) {
        bail!("the greedy fast path runs drafts that read the same target layers; {} reads {:?}, not {layers:?}", d.describe(), d.target_layers());
    }
    let Continuation { tokens, features, stop, secs: target_secs } = greedy_continuation(target, stop_ids, prompt, max_new_tokens, &layers)?;
    let stop = Some(stop);

    let mut records = Vec::with_capacity(drafts.len());
    let mut proposal = Proposal::default();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(0);
    for (draft, head) in drafts.iter_mut() {
        let mut rec = TurnRecord { prompt_tokens: prompt.len(), accepted_per_pos: vec![0; k], target_secs, ..TurnRecord::default() };
        draft.reset();
        // Replay the full loop's steps along the continuation: n tokens known, the last not yet verified.
        let mut n = prompt.len() + 1;
        while n < tokens.len() {
            let remaining = max_new_tokens - (n - prompt.len());
            let k_used = drafts_allowed(k, remaining, ctx_limit.saturating_sub(n));
            let mut accepted = 0;
            if k_used > 0 {
                let ctx = Context { tokens: &tokens[..n], features: &features };
                let t = Instant::now();
                draft.propose(&ctx, k_used, head, DraftMode::Argmax, Sampling::GREEDY, &mut rng, &mut proposal)?;
                rec.draft_secs += t.elapsed().as_secs_f64();
                accepted = proposal.tokens.iter().zip(&tokens[n..]).take_while(|(d, t)| d == t).count();
                // At T = 0 every α is 0 or 1, so the expected accepted count is the accepted count.
                rec.count_step(verification_limit(&proposal.tokens, stop_ids), accepted, accepted as f64);
            }
            draft.rollback(n, accepted)?;
            n += accepted + 1;
        }
        rec.generated = tokens.len() - prompt.len();
        rec.stop = stop;
        records.push(rec);
    }
    Ok((tokens[prompt.len()..].to_vec(), records))
}
