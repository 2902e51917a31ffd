//! What every draft shares whatever engine runs it: the LM head it proposes through (pruned by FR-Spec to a keep
//! set, sliced or masked), the choice of each draft token from that head's logits, and the `Draft` interface.

use super::{HeadRows, Row, TargetModel};
use crate::sampling::{argmax, draw, Sampling};
use crate::vocab::KeepSet;
use anyhow::{bail, Result};
use rayon::prelude::*;
use std::sync::Arc;

/// How a pruned head computes its logits. Both give the same distribution and, for the same random stream, the
/// same drafts: kept ids are sorted, so the sliced head's entries come in the masked head's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadMode {
    /// Gather the kept rows once into a [V′, H] matrix and compute V′ logits (the real speedup).
    Slice,
    /// Compute all V logits and set the pruned ones to −∞ (the seed's logits-processor experiment).
    Mask,
}

/// A draft's LM head before pruning: its rows and, when row r is not token r (EAGLE-3's draft vocabulary),
/// the target id of each row.
#[derive(Clone)]
pub struct LmHead<M> {
    pub matrix: M,
    pub row_ids: Option<Arc<Vec<u32>>>,
    /// The target vocabulary the ids belong to.
    pub vocab: usize,
}

impl<M: HeadRows> LmHead<M> {
    /// A head whose row r is token r.
    pub fn full(matrix: M) -> LmHead<M> {
        let vocab = matrix.rows();
        LmHead { matrix, row_ids: None, vocab }
    }

    fn row_id(&self, row: usize) -> u32 {
        self.row_ids.as_ref().map_or(row as u32, |ids| ids[row])
    }
}

/// The LM head a draft proposes through: the full head, or pruned to a keep set.
pub struct DraftHead<M> {
    lm: LmHead<M>,
    /// Slice mode: the kept rows gathered into one matrix, their target ids and their rows in the LM head.
    sliced: Option<(M, Vec<u32>, Vec<u32>)>,
    /// Mask mode: which rows are kept.
    mask: Option<Vec<bool>>,
    kept: usize,
}

impl<M: HeadRows> DraftHead<M> {
    pub fn new(lm: LmHead<M>, keep: Option<KeepSet>, mode: HeadMode) -> Result<DraftHead<M>> {
        let rows = lm.matrix.rows();
        // A keep set holding every id is no pruning: use the full head in either mode.
        let Some(keep) = keep.filter(|k| k.ids.len() < lm.vocab) else {
            return Ok(DraftHead { lm, sliced: None, mask: None, kept: rows });
        };
        if keep.vocab != lm.vocab {
            bail!("keep set is for a vocabulary of {} ids, the draft head's vocabulary has {}", keep.vocab, lm.vocab);
        }
        let kept_rows: Vec<bool> = (0..rows).map(|r| keep.contains(lm.row_id(r))).collect();
        let kept = kept_rows.iter().filter(|&&k| k).count();
        if kept == 0 {
            bail!("the keep set shares no id with the draft head's vocabulary");
        }
        Ok(match mode {
            HeadMode::Slice => {
                let picked: Vec<u32> = (0..rows as u32).filter(|&r| kept_rows[r as usize]).collect();
                let ids = picked.iter().map(|&r| lm.row_id(r as usize)).collect();
                let sliced = Some((lm.matrix.select_rows(&picked)?, ids, picked));
                DraftHead { lm, sliced, mask: None, kept }
            }
            HeadMode::Mask => DraftHead { lm, sliced: None, mask: Some(kept_rows), kept },
        })
    }

    /// The target vocabulary size.
    pub fn vocab(&self) -> usize {
        self.lm.vocab
    }

    /// Rows the head computes logits for that can be proposed.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Logits of one hidden row in head space: one entry per kept row (slice) or per row (full, mask; pruned
    /// rows are −∞). Kept rows keep their order, so slice and mask draw identically from one random stream.
    pub fn logits(&self, hidden: &M::Row, out: &mut Vec<f32>, scratch: &mut M::Scratch) -> Result<()> {
        self.matrix().logits(hidden, out, scratch)?;
        if let Some(mask) = &self.mask {
            out.iter_mut().zip(mask).filter(|(_, &keep)| !keep).for_each(|(l, _)| *l = f32::NEG_INFINITY);
        }
        Ok(())
    }

    /// The head-space index of the largest logit (what `logits` then `argmax` give).
    pub fn argmax(&self, hidden: &M::Row, logits: &mut Vec<f32>, scratch: &mut M::Scratch) -> Result<usize> {
        if self.mask.is_some() {
            self.logits(hidden, logits, scratch)?;
            return Ok(argmax(logits) as usize);
        }
        self.matrix().argmax(hidden, logits, scratch)
    }

    /// `logits` of several hidden rows through one product of the head.
    pub fn logits_many(&self, hidden: &[&M::Row], out: &mut [&mut Vec<f32>], scratch: &mut M::Scratch) -> Result<()> {
        self.matrix().logits_many(hidden, out, scratch)?;
        if let Some(mask) = &self.mask {
            for out in out.iter_mut() {
                out.iter_mut().zip(mask).filter(|(_, &keep)| !keep).for_each(|(l, _)| *l = f32::NEG_INFINITY);
            }
        }
        Ok(())
    }

    /// `argmax` of several hidden rows through one product of the head, into `indices`.
    pub fn argmax_many(&self, hidden: &[&M::Row], logits: &mut [&mut Vec<f32>], scratch: &mut M::Scratch, indices: &mut Vec<usize>) -> Result<()> {
        if self.mask.is_some() {
            self.logits_many(hidden, logits, scratch)?;
            indices.clear();
            indices.extend(logits.iter().map(|l| argmax(l) as usize));
            return Ok(());
        }
        self.matrix().argmax_many(hidden, logits, scratch, indices)
    }

    /// The rows the head computes: the kept ones gathered (slice), or all of them.
    fn matrix(&self) -> &M {
        self.sliced.as_ref().map_or(&self.lm.matrix, |(m, _, _)| m)
    }

    /// Where this head's rows are among `cover`'s, when a product of `cover` gives this head's logits: both slice
    /// the same LM head (`HeadRows::shares_rows_with`), neither masks, and every row kept here is kept there. Kept
    /// rows are in LM-head order in both, so the positions increase and a sequence's logits gathered from them come
    /// in the order of its own head's.
    pub fn rows_within(&self, cover: &DraftHead<M>) -> Option<Vec<u32>> {
        if self.mask.is_some() || cover.mask.is_some() || !self.lm.matrix.shares_rows_with(&cover.lm.matrix) {
            return None;
        }
        let all = |n: usize| (0..n as u32).collect::<Vec<u32>>();
        let mine = self.sliced.as_ref().map_or_else(|| all(self.lm.matrix.rows()), |(_, _, rows)| rows.clone());
        let Some((_, _, theirs)) = &cover.sliced else {
            return Some(mine);
        };
        let mut at = 0;
        mine.iter()
            .map(|row| {
                at += theirs[at..].iter().position(|r| r == row)?;
                Some(at as u32)
            })
            .collect()
    }

    /// A hidden row of the head's width, for timing it.
    pub fn probe(&self) -> Result<M::Row> {
        self.lm.matrix.probe()
    }

    /// Token id of a head-space index.
    pub fn id(&self, index: usize) -> u32 {
        match &self.sliced {
            Some((_, ids, _)) => ids[index],
            None => self.lm.row_id(index),
        }
    }
}

impl<M: HeadRows> super::TokenIds for DraftHead<M> {
    fn id(&self, index: usize) -> u32 {
        DraftHead::id(self, index)
    }
}

/// How drafts are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftMode {
    /// vLLM: the draft's argmax, treated as a point mass (acceptance probability p(x)).
    Argmax,
    /// Full speculative sampling: draw from the draft's softmax q; accept with min(1, p/q).
    Sample,
}

/// The k tokens of one drafting round and what verification needs of the draft's distributions.
#[derive(Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// q(token) for each proposed token.
    pub q_token: Vec<f32>,
    /// Per step, q over head space; empty when q is a point mass (argmax drafts, or greedy sampling).
    pub q: Vec<Vec<f32>>,
}

impl Proposal {
    pub(super) fn clear(&mut self) {
        self.tokens.clear();
        self.q_token.clear();
    }
}

/// Reusable buffers for choosing a draft token through heads of type `M`.
pub struct Chooser<M: HeadRows> {
    logits: Vec<f32>,
    /// Logits over a covering head's rows (`choose_many`), before this draft's are gathered from them.
    covering: Vec<f32>,
    order: Vec<u32>,
    pub scratch: M::Scratch,
}

impl<M: HeadRows> Default for Chooser<M> {
    fn default() -> Self {
        Chooser { logits: Vec::new(), covering: Vec::new(), order: Vec::new(), scratch: M::Scratch::default() }
    }
}

impl<M: HeadRows> Chooser<M> {
    /// Choose the next draft token from a hidden row and record it (with q) in `out`.
    fn choose(&mut self, head: &DraftHead<M>, hidden: &M::Row, mode: DraftMode, sampling: Sampling, rng: &mut dyn rand::Rng, out: &mut Proposal) -> Result<()> {
        if takes_argmax(mode, sampling) {
            push_argmax(head, head.argmax(hidden, &mut self.logits, &mut self.scratch)?, out);
            return Ok(());
        }
        head.logits(hidden, &mut self.logits, &mut self.scratch)?;
        self.push_draw(head, sampling, rng, out);
        Ok(())
    }

    /// Draw the next draft token from the head's logits (in `self.logits`) and record it with q.
    fn push_draw(&mut self, head: &DraftHead<M>, sampling: Sampling, rng: &mut dyn rand::Rng, out: &mut Proposal) {
        sampling.distribution(&self.logits, next_q(out), &mut self.order);
        push_drawn(head, rng, out);
    }
}

/// Where the next step's q goes in `out`.
fn next_q(out: &mut Proposal) -> &mut Vec<f32> {
    let step = out.tokens.len();
    if out.q.len() <= step {
        out.q.resize_with(step + 1, Vec::new);
    }
    &mut out.q[step]
}

/// Draw the next draft token from its q (already in `next_q(out)`) and record it.
fn push_drawn<M: HeadRows>(head: &DraftHead<M>, rng: &mut dyn rand::Rng, out: &mut Proposal) {
    let q = &out.q[out.tokens.len()];
    let index = draw(q, rng) as usize;
    let q_token = q[index];
    out.tokens.push(head.id(index));
    out.q_token.push(q_token);
}

/// Whether drafts are the head's argmax (a point mass) rather than draws from its distribution.
fn takes_argmax(mode: DraftMode, sampling: Sampling) -> bool {
    mode == DraftMode::Argmax || sampling.is_greedy()
}

/// Record head-space index `index`, the argmax, as the next draft token (q = 1).
fn push_argmax<M: HeadRows>(head: &DraftHead<M>, index: usize, out: &mut Proposal) {
    let step = out.tokens.len();
    out.tokens.push(head.id(index));
    out.q_token.push(1.0);
    if out.q.len() > step {
        out.q[step].clear();
    }
}

/// One sequence's part in `choose_many`: its draft's chooser, its hidden row, its stream, its proposal, its head and,
/// when that is not the head of the product, where its rows are among the product's (`DraftHead::rows_within`).
pub struct Choice<'a, M: HeadRows> {
    pub chooser: &'a mut Chooser<M>,
    pub hidden: &'a M::Row,
    pub rng: &'a mut dyn rand::Rng,
    pub out: &'a mut Proposal,
    pub head: &'a DraftHead<M>,
    pub within: Option<&'a [u32]>,
}

/// The next draft token of several sequences that draft through `cover` or through heads within it: one product of
/// `cover` for all of their hidden rows, then each sequence's choice from its own logits (gathered from the
/// product's when its head is another) with its own stream, as `Chooser::choose` makes it alone (on an engine whose
/// products do not depend on their neighbours, the same tokens and q).
pub fn choose_many<M: HeadRows>(
    cover: &DraftHead<M>,
    choices: &mut [Choice<'_, M>],
    mode: DraftMode,
    sampling: Sampling,
    scratch: &mut M::Scratch,
    indices: &mut Vec<usize>,
) -> Result<()> {
    if let [one] = choices {
        if one.within.is_none() {
            return one.chooser.choose(cover, one.hidden, mode, sampling, one.rng, one.out);
        }
    }
    let hidden: Vec<&M::Row> = choices.iter().map(|c| c.hidden).collect();
    let argmax_only = takes_argmax(mode, sampling);
    if choices.iter().all(|c| c.within.is_none()) {
        let mut logits: Vec<&mut Vec<f32>> = choices.iter_mut().map(|c| &mut c.chooser.logits).collect();
        if argmax_only {
            cover.argmax_many(&hidden, &mut logits, scratch, indices)?;
            for (c, &index) in choices.iter_mut().zip(indices.iter()) {
                push_argmax(cover, index, c.out);
            }
            return Ok(());
        }
        cover.logits_many(&hidden, &mut logits, scratch)?;
    } else {
        let mut logits: Vec<&mut Vec<f32>> = choices.iter_mut().map(|c| if c.within.is_some() { &mut c.chooser.covering } else { &mut c.chooser.logits }).collect();
        cover.logits_many(&hidden, &mut logits, scratch)?;
        for c in choices.iter_mut() {
            if let Some(within) = c.within {
                let chooser = &mut *c.chooser;
                chooser.logits.clear();
                chooser.logits.extend(within.iter().map(|&i| chooser.covering[i as usize]));
            }
        }
    }
    if argmax_only {
        for c in choices.iter_mut() {
            push_argmax(c.head, argmax(&c.chooser.logits) as usize, c.out);
        }
        return Ok(());
    }
    // The distributions side by side on rayon's threads, each as it is alone (with a batch of sampled sequences they
    // ran on one core while the engine's threads waited), then the draws in order, each from its own stream.
    let mut distributions: Vec<(&[f32], &mut Vec<u32>, &mut Vec<f32>)> = choices
        .iter_mut()
        .map(|c| {
            let chooser = &mut *c.chooser;
            (&chooser.logits[..], &mut chooser.order, next_q(c.out))
        })
        .collect();
    distributions.par_iter_mut().for_each(|(logits, order, q)| sampling.distribution(logits, q, order));
    for c in choices.iter_mut() {
        push_drawn(c.head, c.rng, c.out);
    }
    Ok(())
}

/// The sequence so far as the draft sees it.
pub struct Context<'a, F> {
    /// Every token; the last one has not been through the target yet.
    pub tokens: &'a [u32],
    /// The target's captured features, at least `tokens.len() - 1` positions (later ones are not read).
    pub features: &'a F,
}

impl<F> Clone for Context<'_, F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for Context<'_, F> {}

/// What a draft is fed at one drafting position: the sequence to catch up on (the first position of a step), or the
/// token it proposed last.
pub enum Feed<'a, F> {
    CatchUp(Context<'a, F>),
    Extend(u32),
}

impl<F> Clone for Feed<'_, F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for Feed<'_, F> {}

impl<F> Feed<'_, F> {
    /// Feed `draft` alone; its head input.
    pub fn to<T: TargetModel<Features = F>>(&self, draft: &mut dyn Draft<T>) -> Result<Row<T>> {
        match self {
            Feed::CatchUp(ctx) => draft.catch_up(ctx),
            Feed::Extend(token) => draft.extend(*token),
        }
    }
}

/// A draft's own state as `TargetModel::feed_together` takes it: drafts whose weights are the same run together.
pub trait SharedWeights {
    /// What identifies the weights.
    fn weights(&self) -> *const ();
}

/// A draft for targets of type `T`: it keeps its own cache, follows the sequence and proposes tokens.
pub trait Draft<T: TargetModel> {
    fn describe(&self) -> String;
    /// The LM head the draft's logits come from (before pruning).
    fn lm_head(&self) -> LmHead<T::Head>;
    /// Target layers whose input streams the draft reads (EAGLE-3's auxiliary hidden states).
    fn target_layers(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Forget the sequence (a new turn).
    fn reset(&mut self);
    /// Process what the draft has not seen of `ctx`; returns the head input (a hidden row) for the first draft.
    fn catch_up(&mut self, ctx: &Context<T::Features>) -> Result<Row<T>>;
    /// Feed the draft token just chosen; returns the head input for the next one.
    fn extend(&mut self, token: u32) -> Result<Row<T>>;
    /// Verification kept `accepted` of the proposals of a round that began with `before` tokens.
    fn rollback(&mut self, before: usize, accepted: usize) -> Result<()>;
    fn chooser(&mut self) -> &mut Chooser<T::Head>;
    /// What `TargetModel::feed_drafts` needs to run this draft beside its siblings; None: it is fed alone.
    fn state(&mut self) -> Option<&mut T::DraftState> {
        None
    }

    /// Propose `k` tokens after `ctx.tokens`: catch up, then choose and extend one token at a time.
    #[allow(clippy::too_many_arguments)]
    fn propose(
        &mut self,
        ctx: &Context<T::Features>,
        k: usize,
        head: &DraftHead<T::Head>,
        mode: DraftMode,
        sampling: Sampling,
        rng: &mut dyn rand::Rng,
        out: &mut Proposal,
    ) -> Result<()> {
        out.clear();
        let mut row = self.catch_up(ctx)?;
        for step in 0..k {
            self.chooser().choose(head, &row, mode, sampling, rng, out)?;
            if step + 1 < k {
                row = self.extend(out.tokens[step])?;
            }
        }
        Ok(())
    }
}

/// Which kind of draft `--draft` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// An EAGLE-1 head folder.
    Eagle,
    /// An EAGLE-3 head folder.
    Eagle3,
    /// An independent model sharing the target's tokenizer.
    Model,
    /// The target's first N layers (+ final norm + LM head); needs no `--draft`.
    Truncated(usize),
}

impl std::str::FromStr for DraftKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<DraftKind> {
        match s {
            "eagle" => Ok(DraftKind::Eagle),
            "eagle3" => Ok(DraftKind::Eagle3),
            "model" => Ok(DraftKind::Model),
            _ => match s.strip_prefix("truncated:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(DraftKind::Truncated(n)),
                _ => bail!("draft kind '{s}' is not one of eagle, eagle3, model, truncated:N (N ≥ 1)"),
            },
        }
    }
}

impl std::fmt::Display for DraftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftKind::Eagle => f.write_str("eagle"),
            DraftKind::Eagle3 => f.write_str("eagle3"),
            DraftKind::Model => f.write_str("model"),
            DraftKind::Truncated(n) => write!(f, "truncated:{n}"),
        }
    }
}
