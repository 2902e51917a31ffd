//! The speculative loop: draft k tokens, verify them in one target forward over k+1 positions, accept or reject
//! (rejection sampling), emit the recovered or bonus token, roll both caches back to the accepted prefix.
//! Counters follow vLLM's definitions (../shared/reference/NOTES.md) so numbers compare with the literature.

use super::draft::{choose_many, Choice, Context, Draft, DraftHead, DraftMode, Feed, Proposal};
use super::generate::StopReason;
use super::logits::{DrawRequest, LogitRows, Without};
use super::{Block, HeadRows, Positions, Row, TargetModel};
use crate::sampling::Sampling;
use crate::stats::{Counts, Metric};
use anyhow::{bail, Result};
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use std::collections::HashMap;
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

    /// Whether the counts relate as `count_step` makes them. A record read back from a sweep's journal may have been
    /// damaged or edited, and summaries built on one that is not would be nonsense (an acceptance rate of 2475%).
    pub fn check(&self) -> std::result::Result<(), String> {
        let per_position = self.accepted_per_pos.iter().try_fold(0u64, |sum, &c| sum.checked_add(c));
        let descending = self.accepted_per_pos.windows(2).all(|w| w[0] >= w[1]);
        let expected_ok = self.expected_accepted.is_finite()
            && self.expected_accepted >= 0.0
            && self.expected_accepted <= self.draft_tokens as f64 * (1.0 + 1e-9);
        let secs_ok = [self.draft_secs, self.target_secs].iter().all(|s| s.is_finite() && *s >= 0.0);
        let problem = if self.accepted > self.draft_tokens {
            "more tokens accepted than drafted"
        } else if per_position != Some(self.accepted) || !descending || self.accepted_per_pos.first().is_some_and(|&c| c > self.drafts) {
            "the per-position counts do not add up to the accepted tokens"
        } else if !expected_ok {
            "the expected accepted count is out of range"
        } else if !secs_ok {
            "a time is negative or not a number"
        } else {
            return Ok(());
        };
        Err(problem.to_string())
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

/// A turn for the loop to decode: its prompt, the (pruned) head its drafts go through and its own random stream,
/// from which every draw of the turn comes, whatever else the loop decodes beside it.
pub struct TurnJob<'h, H> {
    /// The caller's name for the turn, handed back when it finishes.
    pub id: usize,
    pub prompt: Vec<u32>,
    pub head: &'h DraftHead<H>,
    pub rng: Box<dyn rand::Rng + 'h>,
}

/// Where the loop takes its turns from and gives them back.
pub trait Turns<'h, H> {
    /// The next turn to start, in a fixed order; None when there is none for now (a turn that follows one still
    /// running may come later: the loop asks again each time a slot frees).
    fn next(&mut self) -> Result<Option<TurnJob<'h, H>>>;
    /// Turn `id` finished with these generated ids (ending with the stop token when that ended it).
    fn finished(&mut self, id: usize, tokens: Vec<u32>, record: TurnRecord) -> Result<()>;
}

/// A turn being decoded in one of the loop's slots.
struct Running<'h, H> {
    id: usize,
    head: &'h DraftHead<H>,
    rng: Box<dyn rand::Rng + 'h>,
    prompt_len: usize,
    rec: TurnRecord,
}

/// One slot of the loop: the turn it holds and the state that is reused from turn to turn.
struct Slot<'h, T: TargetModel> {
    turn: Option<Running<'h, T::Head>>,
    tokens: Vec<u32>,
    cache: T::Cache,
    features: T::Features,
    /// This step's block for the target, the rows of it whose logits it decides with, and where they start among
    /// the step's logit rows.
    block: Vec<u32>,
    rows: Vec<usize>,
    first_row: usize,
    /// Drafts proposed this step, and the token count before it.
    k: usize,
    n: usize,
    proposal: Proposal,
}

impl<T: TargetModel> Slot<'_, T> {
    /// Whether the slot's turn has yet to send its prompt through the target (then its block is the prompt).
    fn prefilling(&self) -> bool {
        self.turn.as_ref().is_some_and(|t| self.tokens.len() == t.prompt_len)
    }
}

/// Speculative decoding of every turn `turns` hands out, `drafts.len()` at a time: each step, every slot drafts with
/// its own draft, side by side (`SideBySide`), and the target verifies all slots' blocks in one `forward_blocks`; a
/// finished turn's slot takes the next turn at once (its prompt joins the next forward). A prompt's positions that
/// some slot already holds (the same prompt at another ratio, or the chat before a later turn) are copied from that
/// slot rather than forwarded again (`Positions::copy_prefix`); a turn whose prompt is being forwarded in another
/// slot this step waits one step to start from those rows. A turn's draws come from its own stream in the order one
/// turn alone would make them, so on an engine whose blocks do not depend on their neighbours, nor a block on how
/// its sequence was cut into blocks, its record and tokens do not depend on the number of slots (tested). Time of a
/// shared forward is split equally.
pub fn speculative_turns<'h, T: TargetModel>(
    target: &T,
    stop_ids: &[u32],
    drafts: &mut [&mut dyn Draft<T>],
    cfg: &SpecConfig,
    turns: &mut dyn Turns<'h, T::Head>,
) -> Result<()>
where
    T::Head: 'h,
{
    if cfg.k == 0 {
        bail!("k (draft tokens per step) must be at least 1");
    }
    if drafts.is_empty() {
        bail!("speculative decoding needs at least one draft slot");
    }
    let (v, ctx_limit) = (target.vocab(), target.context_length());
    let layers = drafts[0].target_layers();
    if let Some(d) = drafts.iter().find(|d| d.target_layers() != layers) {
        bail!("the drafts of one loop read the same target layers; {} reads {:?}, not {layers:?}", d.describe(), d.target_layers());
    }
    let mut slots: Vec<Slot<T>> = (0..drafts.len())
        .map(|_| Slot {
            turn: None,
            tokens: Vec::new(),
            cache: target.new_cache(),
            features: target.new_features(&layers),
            block: Vec::new(),
            rows: Vec::new(),
            first_row: 0,
            k: 0,
            n: 0,
            proposal: Proposal::default(),
        })
        .collect();
    let mut side_by_side = SideBySide::<T>::new();
    let mut verifying = Verifying::<T>::default();
    let stopped = |t: u32| stop_ids.contains(&t);
    // A turn handed out but not started: its prompt was being forwarded in another slot.
    let mut waiting: Option<TurnJob<'h, T::Head>> = None;
    loop {
        // Turns out of new tokens or context end before drafting.
        for slot in slots.iter_mut().filter(|s| s.turn.is_some() && !s.prefilling()) {
            let turn = slot.turn.as_mut().expect("filtered");
            let remaining = cfg.max_new_tokens.saturating_sub(slot.tokens.len() - turn.prompt_len);
            // One step emits up to k + 1 tokens and needs k + 1 more positions in the target's context.
            let room = ctx_limit.saturating_sub(slot.cache.len() + 1);
            if remaining == 0 || room == 0 {
                turn.rec.stop = Some(if remaining == 0 { StopReason::MaxTokens } else { StopReason::ContextLimit });
                finish(slot, turns)?;
            } else {
                slot.k = drafts_allowed(cfg.k, remaining, room);
            }
        }
        // Free slots take the next turns, in order.
        for i in 0..slots.len() {
            if slots[i].turn.is_some() {
                continue;
            }
            let Some(job) = waiting.take().map_or_else(|| turns.next(), |job| Ok(Some(job)))? else { break };
            if job.prompt.is_empty() {
                bail!("empty prompt");
            }
            if job.head.vocab() != v {
                bail!("the draft head has {} rows, the target vocabulary is {v}", job.head.vocab());
            }
            // The prompt's last position is forwarded whatever is held: its logits give the first draw.
            let wanted = &job.prompt[..job.prompt.len() - 1];
            let (source, held) = held_prefix(&slots, i, wanted);
            let coming = slots.iter().filter(|s| s.prefilling()).map(|s| common_prefix(&s.tokens, wanted)).max().unwrap_or(0);
            if coming > held {
                waiting = Some(job);
                break;
            }
            drafts[i].reset();
            if source == i {
                slots[i].cache.truncate(held)?;
                slots[i].features.truncate(held)?;
            } else {
                let (slot, from) = pair(&mut slots, i, source);
                slot.cache.copy_prefix(&from.cache, held)?;
                slot.features.copy_prefix(&from.features, held)?;
            }
            let slot = &mut slots[i];
            slot.block.clear();
            slot.block.extend_from_slice(&job.prompt[held..]);
            slot.rows.clear();
            slot.rows.push(job.prompt.len() - 1 - held);
            let rec = TurnRecord { prompt_tokens: job.prompt.len(), accepted_per_pos: vec![0; cfg.k], ..TurnRecord::default() };
            slot.turn = Some(Running { id: job.id, head: job.head, rng: job.rng, prompt_len: job.prompt.len(), rec });
            slot.tokens = job.prompt;
        }
        let active = slots.iter().filter(|s| s.turn.is_some()).count();
        if active == 0 {
            return Ok(());
        }

        let mut seqs: Vec<Drafting<T>> = slots
            .iter_mut()
            .enumerate()
            .filter(|(_, s)| s.turn.is_some() && !s.prefilling())
            .map(|(i, s)| {
                s.n = s.tokens.len();
                let turn = s.turn.as_mut().expect("filtered");
                let ctx = Context { tokens: &s.tokens, features: &s.features };
                Drafting { slot: i, ctx, k: s.k, head: turn.head, rng: turn.rng.as_mut(), proposal: &mut s.proposal, secs: &mut turn.rec.draft_secs }
            })
            .collect();
        side_by_side.draft(target, &mut seqs, drafts, cfg.mode, cfg.sampling)?;
        drop(seqs);
        for slot in slots.iter_mut().filter(|s| s.turn.is_some() && !s.prefilling()) {
            slot.block.clear();
            slot.block.push(slot.tokens[slot.n - 1]);
            slot.block.extend_from_slice(&slot.proposal.tokens);
            slot.rows.clear();
            slot.rows.extend(0..=slot.k);
        }

        let t = Instant::now();
        let mut blocks: Vec<Block<T>> = Vec::with_capacity(active);
        let mut first_row = 0;
        for s in slots.iter_mut().filter(|s| s.turn.is_some()) {
            s.first_row = first_row;
            first_row += s.rows.len();
            blocks.push(Block { tokens: &s.block, cache: &mut s.cache, logit_rows: &s.rows, features: Some(&mut s.features) });
        }
        target.forward_blocks(&mut blocks, &mut verifying.logits)?;
        drop(blocks);
        verifying.decide(&mut slots, cfg, stop_ids)?;
        let shared = t.elapsed().as_secs_f64() / active as f64;

        let mut drawn = verifying.drawn.iter();
        for (slot, draft) in slots.iter_mut().zip(drafts.iter_mut()).filter(|(s, _)| s.turn.is_some()) {
            let t = Instant::now();
            let verdict = *drawn.next().expect("one verdict a slot");
            if slot.prefilling() {
                let turn = slot.turn.as_mut().expect("filtered");
                let first = verdict.next.expect("a prefilled turn draws its first token");
                slot.tokens.push(first);
                if stopped(first) {
                    turn.rec.stop = Some(StopReason::EndOfTurn);
                }
            } else {
                slot.accept(verdict, stop_ids)?;
                draft.rollback(slot.n, verdict.accepted)?;
            }
            let turn = slot.turn.as_mut().expect("still held");
            turn.rec.target_secs += shared + t.elapsed().as_secs_f64();
            if turn.rec.stop.is_some() {
                finish(slot, turns)?;
            }
        }
    }
}

/// The slot holding the longest prefix of `wanted` in its cache, and that prefix's length; slot `own` (about to
/// take a turn, its last turn's positions still held) when none holds more, so that it only truncates.
fn held_prefix<T: TargetModel>(slots: &[Slot<T>], own: usize, wanted: &[u32]) -> (usize, usize) {
    let held = |s: &Slot<T>| common_prefix(&s.tokens[..s.cache.len().min(s.features.len()).min(s.tokens.len())], wanted);
    let mut best = (own, held(&slots[own]));
    for (j, s) in slots.iter().enumerate() {
        let n = held(s);
        if n > best.1 {
            best = (j, n);
        }
    }
    best
}

/// The number of leading ids `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Slot `i` to write beside slot `j` to read (`i != j`).
fn pair<S>(slots: &mut [S], i: usize, j: usize) -> (&mut S, &S) {
    if i < j {
        let (left, right) = slots.split_at_mut(j);
        (&mut left[i], &right[0])
    } else {
        let (left, right) = slots.split_at_mut(i);
        (&mut right[0], &left[j])
    }
}

/// What the loop verifies with: the step's logit rows where the target keeps them, and the buffers of the questions
/// it asks them, reused from step to step.
struct Verifying<T: TargetModel> {
    logits: T::Logits,
    picks: Vec<(usize, u32)>,
    probabilities: Vec<f32>,
    tokens: Vec<u32>,
    /// Per running slot, in order.
    drawn: Vec<Verdict>,
}

/// A slot's step: the drafts it accepted, and the token drawn after them (the first after a prompt; None when the
/// last accepted draft ended the turn).
#[derive(Clone, Copy)]
struct Verdict {
    accepted: usize,
    next: Option<u32>,
}

impl<T: TargetModel> Default for Verifying<T> {
    fn default() -> Self {
        Verifying { logits: T::Logits::default(), picks: Vec::new(), probabilities: Vec::new(), tokens: Vec::new(), drawn: Vec::new() }
    }
}

impl<T: TargetModel> Verifying<T> {
    /// Every running slot's verdict on its drafts (rejection sampling: each draft x accepted with probability
    /// min(1, p(x) / q(x)), the first rejected one replaced by a draw from norm(max(0, p − q)), a bonus token drawn
    /// from p when all are accepted) and its first token after a prompt. The target is asked twice for all slots
    /// together: every draft's p(x), then every draw. A slot takes its uniform numbers from its own stream in the
    /// order one slot alone does, and counts its step (`count_step`); `Slot::accept` applies the verdict.
    fn decide<'h>(&mut self, slots: &mut [Slot<'h, T>], cfg: &SpecConfig, stop_ids: &[u32]) -> Result<()> {
        self.picks.clear();
        for s in slots.iter().filter(|s| s.turn.is_some() && !s.prefilling()) {
            let limit = verification_limit(&s.proposal.tokens[..s.k], stop_ids);
            self.picks.extend((0..limit).map(|i| (s.first_row + i, s.proposal.tokens[i])));
        }
        self.logits.probabilities(cfg.sampling, &self.picks, &mut self.probabilities)?;
        let mut p = self.probabilities.iter().copied();
        let mut requests = Vec::with_capacity(slots.len());
        let mut verdicts = Vec::with_capacity(slots.len());
        for slot in slots.iter_mut().filter(|s| s.turn.is_some()) {
            let prefilling = slot.prefilling();
            let Slot { turn, proposal, k, first_row, .. } = slot;
            let proposal: &Proposal = proposal;
            let turn = turn.as_mut().expect("filtered");
            if prefilling {
                requests.push(DrawRequest { row: *first_row, u: turn.rng.random(), without: Without::Nothing });
                verdicts.push((0, true));
                continue;
            }
            let limit = verification_limit(&proposal.tokens[..*k], stop_ids);
            let (mut accepted, mut rejected) = (0, None);
            let (mut survive, mut expected) = (1.0f64, 0.0f64);
            for i in 0..limit {
                let alpha = (p.next().expect("one probability a verified draft") as f64 / proposal.q_token[i] as f64).min(1.0);
                survive *= alpha;
                expected += survive;
                if rejected.is_some() {
                    continue;
                }
                if turn.rng.random::<f64>() < alpha {
                    accepted += 1;
                } else {
                    let without = match proposal.q.get(i).filter(|q| !q.is_empty()) {
                        Some(q) => Without::Distribution { q, ids: turn.head },
                        None => Without::Token(proposal.tokens[i]),
                    };
                    rejected = Some(DrawRequest { row: *first_row + i, u: turn.rng.random(), without });
                }
            }
            let ended_on_draft = rejected.is_none() && accepted > 0 && stop_ids.contains(&proposal.tokens[accepted - 1]);
            let request = match rejected {
                Some(r) => Some(r),
                None if ended_on_draft => None,
                None => Some(DrawRequest { row: *first_row + *k, u: turn.rng.random(), without: Without::Nothing }),
            };
            verdicts.push((accepted, request.is_some()));
            requests.extend(request);
            if *k > 0 {
                turn.rec.count_step(limit, accepted, expected);
            }
        }
        self.logits.draw(cfg.sampling, &requests, &mut self.tokens)?;
        let mut tokens = self.tokens.iter().copied();
        self.drawn.clear();
        self.drawn.extend(verdicts.into_iter().map(|(accepted, drew)| Verdict { accepted, next: if drew { tokens.next() } else { None } }));
        Ok(())
    }
}

impl<T: TargetModel> Slot<'_, T> {
    /// Apply a verdict of `Verifying::decide`: keep the drafts accepted and the token drawn after them, and roll the
    /// cache and features back to the accepted prefix.
    fn accept(&mut self, verdict: Verdict, stop_ids: &[u32]) -> Result<()> {
        let turn = self.turn.as_mut().expect("a running turn");
        let (accepted, n) = (verdict.accepted, self.n);
        // Keep the target's positions up to the last accepted draft; the new token is fed next step.
        self.cache.truncate(n + accepted)?;
        self.features.truncate(n + accepted)?;
        for &t in self.proposal.tokens[..accepted].iter().chain(verdict.next.iter()) {
            self.tokens.push(t);
            if stop_ids.contains(&t) {
                turn.rec.stop = Some(StopReason::EndOfTurn);
                break;
            }
        }
        Ok(())
    }
}

/// A sequence drafting beside others (`SideBySide::draft`): the slot of its draft, what it drafts after, how many
/// tokens, through which head, from which stream, and where its proposal and its drafting time go.
struct Drafting<'a, 'h, T: TargetModel> {
    slot: usize,
    ctx: Context<'a, T::Features>,
    k: usize,
    head: &'h DraftHead<T::Head>,
    rng: &'a mut dyn rand::Rng,
    proposal: &'a mut Proposal,
    secs: &'a mut f64,
}

/// How sequences draft: position by position, side by side, so that drafts on the same weights are fed together
/// (`TargetModel::feed_drafts`) and sequences drafting through one head, or through heads nested in one another (the
/// keep sets of several ratios), choose their tokens from one product (the head is read once for all of them, not once
/// a sequence: on a GPU at batch 64, the LM head of Llama-3 is 1 GB a read). The buffers live from step to step.
struct SideBySide<'h, T: TargetModel> {
    /// The drafts fed at this position, and which sequences they draft for.
    fed: Vec<usize>,
    which: Vec<usize>,
    hidden: Vec<Option<Row<T>>>,
    /// Per sequence, the head of the product it chooses from this position, and where its rows are among that
    /// head's (None: its own head).
    covered_by: Vec<Option<(&'h DraftHead<T::Head>, Option<std::sync::Arc<[u32]>>)>>,
    /// `DraftHead::rows_within` of a (head, cover) pair, found once.
    within: HashMap<(*const DraftHead<T::Head>, *const DraftHead<T::Head>), Option<std::sync::Arc<[u32]>>>,
    /// `plan`'s buffers: each sequence's head when it has a row, the distinct heads with their sequence counts, and
    /// the best cost of serving the heads from each on.
    heads: Vec<Option<&'h DraftHead<T::Head>>>,
    distinct: Vec<(&'h DraftHead<T::Head>, usize)>,
    best: Vec<(f64, usize)>,
    scratch: <T::Head as HeadRows>::Scratch,
    indices: Vec<usize>,
}

/// What a head's product costs, in units of reading one of its rows: the read, plus each hidden row's arithmetic at
/// about a sixth of it (`bench head` on the CPU engine: 8 rows of a 49,152-row head 1.3 ms, one row 0.66 ms).
fn product_cost(rows: usize, members: usize) -> f64 {
    rows as f64 * (1.0 + members as f64 / 6.0)
}

impl<'h, T: TargetModel> SideBySide<'h, T> {
    fn new() -> Self {
        SideBySide {
            fed: Vec::new(),
            which: Vec::new(),
            hidden: Vec::new(),
            covered_by: Vec::new(),
            within: HashMap::new(),
            heads: Vec::new(),
            distinct: Vec::new(),
            best: Vec::new(),
            scratch: Default::default(),
            indices: Vec::new(),
        }
    }

    /// `head.rows_within(cover)`, remembered.
    fn within(&mut self, head: &'h DraftHead<T::Head>, cover: &'h DraftHead<T::Head>) -> Option<std::sync::Arc<[u32]>> {
        self.within.entry((head, cover)).or_insert_with(|| head.rows_within(cover).map(Into::into)).clone()
    }

    /// Which product each sequence with a hidden row (its head in `self.heads`) chooses from (`covered_by`): the
    /// distinct heads, largest first, split into runs each served by its first head's product (every other head of
    /// the run within it) at the least total `product_cost`. A run may only be as long as its heads are nested.
    fn plan(&mut self) {
        let mut distinct = std::mem::take(&mut self.distinct);
        distinct.clear();
        for head in self.heads.iter().flatten() {
            match distinct.iter_mut().find(|(h, _)| std::ptr::eq(*h, *head)) {
                Some((_, members)) => *members += 1,
                None => distinct.push((head, 1)),
            }
        }
        distinct.sort_by_key(|(h, _)| std::cmp::Reverse(h.kept()));
        // best[i]: the least cost of serving distinct[i..], and where the run starting at i ends.
        let n = distinct.len();
        let mut best = std::mem::take(&mut self.best);
        best.clear();
        best.resize(n + 1, (0.0, n));
        for i in (0..n).rev() {
            best[i] = (f64::INFINITY, i + 1);
            let mut members = 0;
            for j in i..n {
                if j > i && self.within(distinct[j].0, distinct[i].0).is_none() {
                    break;
                }
                members += distinct[j].1;
                let cost = product_cost(distinct[i].0.kept(), members) + best[j + 1].0;
                if cost < best[i].0 {
                    best[i] = (cost, j + 1);
                }
            }
        }
        self.covered_by.clear();
        self.covered_by.resize(self.heads.len(), None);
        let mut i = 0;
        while i < n {
            let (cover, end) = (distinct[i].0, best[i].1);
            for k in 0..self.heads.len() {
                if let Some(head) = self.heads[k].filter(|h| distinct[i..end].iter().any(|(d, _)| std::ptr::eq(*d, *h))) {
                    let within = if std::ptr::eq(head, cover) { None } else { self.within(head, cover) };
                    self.covered_by[k] = Some((cover, within));
                }
            }
            i = end;
        }
        (self.distinct, self.best) = (distinct, best);
    }

    /// Every sequence of `seqs` (in ascending slot order) proposes its `k` tokens. At each position the drafts of the
    /// sequences still drafting catch up (first position) or extend by their last token, fed together; then the
    /// sequences choose from the products `plan` sets (`choose_many`), products in order. A sequence's draws come from
    /// its own stream in the order it makes them alone, so its proposal does not depend on its neighbours where the
    /// engine's forwards and products do not. Time shared by several sequences (a feed, a product) is split equally.
    fn draft(&mut self, target: &T, seqs: &mut [Drafting<'_, 'h, T>], drafts: &mut [&mut dyn Draft<T>], mode: DraftMode, sampling: Sampling) -> Result<()> {
        self.hidden.clear();
        self.hidden.resize_with(seqs.len(), || None);
        seqs.iter_mut().for_each(|s| s.proposal.clear());
        let positions = seqs.iter().map(|s| s.k).max().unwrap_or(0);
        for step in 0..positions {
            self.which.clear();
            self.which.extend((0..seqs.len()).filter(|&j| step < seqs[j].k));
            self.fed.clear();
            self.fed.extend(self.which.iter().map(|&j| seqs[j].slot));
            let feeds: Vec<Feed<T::Features>> = self
                .which
                .iter()
                .map(|&j| match step {
                    0 => Feed::CatchUp(seqs[j].ctx),
                    _ => Feed::Extend(seqs[j].proposal.tokens[step - 1]),
                })
                .collect();
            let t = Instant::now();
            let mut rows = Vec::with_capacity(feeds.len());
            target.feed_drafts(drafts, &self.fed, &feeds, &mut rows)?;
            let share = t.elapsed().as_secs_f64() / self.fed.len() as f64;
            for (&j, row) in self.which.iter().zip(rows) {
                *seqs[j].secs += share;
                self.hidden[j] = Some(row);
            }
            self.heads.clear();
            self.heads.extend(seqs.iter().zip(&self.hidden).map(|(s, h)| h.as_ref().map(|_| s.head)));
            self.plan();
            for first in 0..seqs.len() {
                // A sequence's row is taken once its product has been chosen from.
                let Some((cover, _)) = self.covered_by[first].clone() else { continue };
                let t = Instant::now();
                let mut choices: Vec<Choice<T::Head>> = Vec::new();
                let mut members = seqs
                    .iter_mut()
                    .zip(&self.hidden)
                    .zip(&self.covered_by)
                    .filter_map(|((s, hidden), by)| by.as_ref().filter(|(c, _)| std::ptr::eq(*c, cover)).map(|(_, within)| (s, hidden, within)))
                    .peekable();
                for (i, draft) in drafts.iter_mut().enumerate() {
                    if let Some((s, hidden, within)) = members.next_if(|(s, _, _)| s.slot == i) {
                        let head = s.head;
                        choices.push(Choice { chooser: draft.chooser(), hidden: hidden.as_ref().expect("planned"), rng: &mut *s.rng, out: &mut *s.proposal, head, within: within.as_deref() });
                    }
                }
                let count = choices.len();
                choose_many(cover, &mut choices, mode, sampling, &mut self.scratch, &mut self.indices)?;
                drop(choices);
                let share = t.elapsed().as_secs_f64() / count as f64;
                for (j, s) in seqs.iter_mut().enumerate() {
                    if self.covered_by[j].as_ref().is_some_and(|(c, _)| std::ptr::eq(*c, cover)) {
                        *s.secs += share;
                        self.hidden[j] = None;
                        self.covered_by[j] = None;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Hand a slot's finished turn back and free the slot.
fn finish<T: TargetModel>(slot: &mut Slot<T>, turns: &mut dyn Turns<'_, T::Head>) -> Result<()> {
    let mut turn = slot.turn.take().expect("a running turn");
    let generated = slot.tokens[turn.prompt_len..].to_vec();
    turn.rec.generated = generated.len();
    turns.finished(turn.id, generated, turn.rec)
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
    /// The one turn, and what became of it.
    struct One<'h, H> {
        job: Option<TurnJob<'h, H>>,
        done: Option<(Vec<u32>, TurnRecord)>,
    }
    impl<'h, H> Turns<'h, H> for One<'h, H> {
        fn next(&mut self) -> Result<Option<TurnJob<'h, H>>> {
            Ok(self.job.take())
        }
        fn finished(&mut self, _: usize, tokens: Vec<u32>, record: TurnRecord) -> Result<()> {
            self.done = Some((tokens, record));
            Ok(())
        }
    }
    let job = TurnJob { id: 0, prompt: prompt.to_vec(), head, rng: Box::new(rng) };
    let mut one = One { job: Some(job), done: None };
    speculative_turns(target, stop_ids, &mut [draft], cfg, &mut one)?;
    Ok(one.done.expect("the loop finishes every turn it starts"))
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
    pub prompt_len: usize,
    pub features: F,
    pub stop: StopReason,
    pub secs: f64,
}

/// The target's greedy continuation of one prompt (`continuations` of one).
pub fn greedy_continuation<T: TargetModel>(target: &T, stop_ids: &[u32], prompt: &[u32], max_new_tokens: usize, layers: &[usize]) -> Result<Continuation<T::Features>> {
    let mut all = greedy_continuations(target, stop_ids, &[prompt], max_new_tokens, layers)?;
    Ok(all.pop().expect("one continuation per prompt"))
}

/// The target's greedy continuations of several prompts, decoded together (`continuations`).
pub fn greedy_continuations<T: TargetModel, P: AsRef<[u32]>>(target: &T, stop_ids: &[u32], prompts: &[P], max_new_tokens: usize, layers: &[usize]) -> Result<Vec<Continuation<T::Features>>> {
    continuations(target, stop_ids, prompts, max_new_tokens, layers, Sampling::GREEDY, &mut |_| 0.0)
}

/// Continuations of several prompts decoded together, each next token drawn from the target's distribution under
/// `sampling` with the uniform number `uniform(sequence)`: the prompts go through the target in one `forward_blocks`,
/// then each step forwards the newest token of every unfinished sequence in one more, so a step's pass over the
/// weights serves them all. Where blocks do not depend
/// on their neighbours (the CPU engine) each continuation is what its prompt gets alone, bit for bit; with a random
/// stream per sequence a sampled one does not depend on the batch either. `secs` is the call's wall time shared
/// equally.
pub fn continuations<T: TargetModel, P: AsRef<[u32]>>(
    target: &T,
    stop_ids: &[u32],
    prompts: &[P],
    max_new_tokens: usize,
    layers: &[usize],
    sampling: Sampling,
    uniform: &mut dyn FnMut(usize) -> f64,
) -> Result<Vec<Continuation<T::Features>>> {
    let prompts: Vec<&[u32]> = prompts.iter().map(|p| p.as_ref()).collect();
    if prompts.iter().any(|p| p.is_empty()) {
        bail!("empty prompt");
    }
    let t0 = Instant::now();
    let ctx_limit = target.context_length();
    struct Sequence<T: TargetModel> {
        tokens: Vec<u32>,
        cache: T::Cache,
        features: T::Features,
        /// Tokens already through the target, and the row of the next block whose logits the next token is drawn from.
        fed: usize,
        rows: [usize; 1],
        stop: Option<StopReason>,
    }
    let mut seqs: Vec<Sequence<T>> = prompts
        .iter()
        .map(|p| Sequence { tokens: p.to_vec(), cache: target.new_cache(), features: target.new_features(layers), fed: 0, rows: [p.len() - 1], stop: None })
        .collect();
    let (mut logits, mut requests, mut drawn) = (T::Logits::default(), Vec::new(), Vec::new());
    loop {
        let mut blocks: Vec<Block<T>> = seqs
            .iter_mut()
            .filter(|s| s.stop.is_none())
            .map(|s| {
                let tokens = &s.tokens[s.fed..];
                s.fed = s.tokens.len();
                Block { tokens, cache: &mut s.cache, logit_rows: &s.rows, features: Some(&mut s.features) }
            })
            .collect();
        if blocks.is_empty() {
            break;
        }
        target.forward_blocks(&mut blocks, &mut logits)?;
        drop(blocks);
        requests.clear();
        for (i, _) in seqs.iter().enumerate().filter(|(_, s)| s.stop.is_none()) {
            requests.push(DrawRequest { row: requests.len(), u: uniform(i), without: Without::Nothing });
        }
        logits.draw(sampling, &requests, &mut drawn)?;
        let mut drawn = drawn.iter().copied();
        for (s, prompt) in seqs.iter_mut().zip(&prompts).filter(|(s, _)| s.stop.is_none()) {
            let next = drawn.next().expect("one token a sequence");
            s.tokens.push(next);
            s.rows = [0];
            s.stop = continuation_stop(next, stop_ids, s.tokens.len() - prompt.len(), max_new_tokens, s.cache.len(), ctx_limit);
        }
    }
    let secs = t0.elapsed().as_secs_f64() / prompts.len() as f64;
    Ok(seqs.into_iter().zip(&prompts).map(|(s, p)| Continuation { tokens: s.tokens, prompt_len: p.len(), features: s.features, stop: s.stop.expect("every sequence stops"), secs }).collect())
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

/// Greedy (T = 0) speculative decoding through several heads at once. Greedy output does not depend on the draft,
/// so the target's continuation is generated once (`greedy_continuation`) and the draft is run along it through
/// each head (`drafts_along`).
pub fn greedy_turns<T: TargetModel>(
    target: &T,
    stop_ids: &[u32],
    draft: &mut dyn Draft<T>,
    heads: &[&DraftHead<T::Head>],
    prompt: &[u32],
    k: usize,
    max_new_tokens: usize,
) -> Result<(Vec<u32>, Vec<TurnRecord>)> {
    let continuation = greedy_continuation(target, stop_ids, prompt, max_new_tokens, &draft.target_layers())?;
    let records = drafts_along(target, stop_ids, &mut [draft], heads, std::slice::from_ref(&continuation), k, max_new_tokens)?;
    Ok((continuation.tokens[prompt.len()..].to_vec(), records.into_iter().next().expect("one continuation")))
}

/// The records greedy speculative decoding gives along the target's greedy `continuations`, one per continuation and
/// head (`[continuation][head]`): a draft token is accepted while it matches the continuation, and the next token is
/// the continuation's. The target features the drafts read come from that one pass. The (continuation, head) pairs
/// run side by side, as many at a time as there are `drafts`, head by head, each drafting position of all of them
/// fed together and chosen with one product per head (`SideBySide`). Where the engine's blocks are bit-identical to
/// single steps (the CPU engine) each record equals the full loop's (tested); only `target_secs`, the shared pass,
/// is the same for every head.
pub fn drafts_along<T: TargetModel>(
    target: &T,
    stop_ids: &[u32],
    drafts: &mut [&mut dyn Draft<T>],
    heads: &[&DraftHead<T::Head>],
    continuations: &[Continuation<T::Features>],
    k: usize,
    max_new_tokens: usize,
) -> Result<Vec<Vec<TurnRecord>>> {
    if k == 0 {
        bail!("k (draft tokens per step) must be at least 1");
    }
    if drafts.is_empty() {
        bail!("drafting along a continuation needs at least one draft");
    }
    /// A (continuation, head) pair in a draft's slot: `n` tokens known, the last not yet verified.
    struct Along {
        continuation: usize,
        head: usize,
        n: usize,
        k: usize,
        rec: TurnRecord,
        proposal: Proposal,
    }
    let ctx_limit = target.context_length();
    // Head by head, so that the pairs side by side mostly share a head and choose from one product of it.
    let mut pairs = (0..heads.len()).flat_map(|h| (0..continuations.len()).map(move |c| (c, h)));
    let mut records: Vec<Vec<Option<TurnRecord>>> = continuations.iter().map(|_| vec![None; heads.len()]).collect();
    let mut slots: Vec<Option<Along>> = drafts.iter().map(|_| None).collect();
    // Argmax drafts draw nothing; the streams are there because choosing takes one.
    let mut rngs: Vec<rand_chacha::ChaCha20Rng> = drafts.iter().map(|_| rand_chacha::ChaCha20Rng::seed_from_u64(0)).collect();
    let mut side_by_side = SideBySide::<T>::new();
    loop {
        for (slot, draft) in slots.iter_mut().zip(drafts.iter_mut()) {
            // A pair is done at the end of its continuation (at once for a one-token one); its slot takes the next.
            loop {
                if let Some(a) = slot.take_if(|a| a.n >= continuations[a.continuation].tokens.len()) {
                    let c = &continuations[a.continuation];
                    records[a.continuation][a.head] = Some(TurnRecord { generated: c.tokens.len() - c.prompt_len, stop: Some(c.stop), ..a.rec });
                }
                if slot.is_some() {
                    break;
                }
                let Some((continuation, head)) = pairs.next() else { break };
                let c = &continuations[continuation];
                draft.reset();
                let rec = TurnRecord { prompt_tokens: c.prompt_len, accepted_per_pos: vec![0; k], target_secs: c.secs, ..TurnRecord::default() };
                *slot = Some(Along { continuation, head, n: c.prompt_len + 1, k: 0, rec, proposal: Proposal::default() });
            }
        }
        if slots.iter().all(Option::is_none) {
            break;
        }
        let mut seqs: Vec<Drafting<T>> = slots
            .iter_mut()
            .zip(rngs.iter_mut())
            .enumerate()
            .filter_map(|(i, (slot, rng))| {
                let a = slot.as_mut()?;
                let c = &continuations[a.continuation];
                a.k = drafts_allowed(k, max_new_tokens - (a.n - c.prompt_len), ctx_limit.saturating_sub(a.n));
                let ctx = Context { tokens: &c.tokens[..a.n], features: &c.features };
                Some(Drafting { slot: i, ctx, k: a.k, head: heads[a.head], rng, proposal: &mut a.proposal, secs: &mut a.rec.draft_secs })
            })
            .collect();
        side_by_side.draft(target, &mut seqs, drafts, DraftMode::Argmax, Sampling::GREEDY)?;
        drop(seqs);
        for (a, draft) in slots.iter_mut().zip(drafts.iter_mut()).filter_map(|(slot, draft)| Some((slot.as_mut()?, draft))) {
            let tokens = &continuations[a.continuation].tokens;
            let accepted = a.proposal.tokens.iter().zip(&tokens[a.n..]).take_while(|(d, t)| d == t).count();
            if a.k > 0 {
                // At T = 0 every α is 0 or 1, so the expected accepted count is the accepted count.
                a.rec.count_step(verification_limit(&a.proposal.tokens, stop_ids), accepted, accepted as f64);
            }
            draft.rollback(a.n, accepted)?;
            a.n += accepted + 1;
        }
    }
    Ok(records.into_iter().map(|per_head| per_head.into_iter().map(|r| r.expect("every pair ran")).collect()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_that_count_steps_pass_their_check_and_edited_ones_do_not() {
        let mut rec = TurnRecord { accepted_per_pos: vec![0; 4], ..TurnRecord::default() };
        for (verified, accepted) in [(4, 2), (4, 4), (3, 0), (1, 1)] {
            rec.count_step(verified, accepted, accepted as f64 * 0.9);
        }
        assert_eq!(rec.check(), Ok(()));
        let edits: [fn(&mut TurnRecord); 5] = [
            |r| r.accepted = 99,
            |r| r.accepted_per_pos[0] += 1,
            |r| r.expected_accepted = f64::NAN,
            |r| r.expected_accepted = 1e9,
            |r| r.target_secs = -1.0,
        ];
        for edit in edits {
            let mut bad = rec.clone();
            edit(&mut bad);
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
