//! The speculative core, written once for every engine: the draft-verify loop with its counters, the T = 0 fast
//! path, target-only generation, and FR-Spec's pruned draft heads. It knows engines only through the traits below:
//! a target forwards token blocks over a cache that rolls back, keeps the logit rows the loop asks for and answers
//! what the loop decides with (a draft's probability, a draw: `LogitRows`), while its captured features stay on the
//! engine's device; a draft catches up on accepted tokens and proposes through an LM head whose kept rows live on
//! that device too.
//!
//! Engines: `engine::cpu` (frspec's bit-exact kernels) and `engine::candle` (candle tensors on the CPU or a GPU).

pub mod decode;
pub mod draft;
pub mod generate;
pub mod logits;

pub use decode::{greedy_turns, speculative_turn, SpecConfig, TurnRecord};
pub use draft::{Chooser, Context, Draft, DraftHead, DraftKind, DraftMode, Feed, HeadMode, LmHead, Proposal, SharedWeights};
pub use generate::{generate, Generation, StopReason};
pub use logits::{DrawRequest, HostLogits, LogitRows, TokenIds, Without};

use anyhow::Result;

/// Per-sequence state indexed by position (a KV cache, captured features) that rolls back to a prefix.
pub trait Positions {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget positions `len..` (rejected drafts).
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Hold the first `len` positions of `from` instead of this sequence's own: a turn whose prompt another sequence
    /// of the same model has been through starts from its rows.
    fn copy_prefix(&mut self, from: &Self, len: usize) -> Result<()>;
}

/// A target model as the loop drives it.
pub trait TargetModel {
    /// One sequence's keys and values.
    type Cache: Positions;
    /// One sequence's captured features, one row per position the cache holds: the post-norm hidden state (what
    /// EAGLE-1 reads) and the inputs of the layers `new_features` was asked for (EAGLE-3's auxiliary states).
    type Features: Positions;
    /// An LM head's rows on this engine.
    type Head: HeadRows;
    /// What a draft on this engine lets `feed_drafts` run beside its siblings (`Draft::state`).
    type DraftState: SharedWeights;
    /// The logit rows of `forward_blocks`, where this engine keeps them.
    type Logits: LogitRows + Default;

    fn vocab(&self) -> usize;
    fn context_length(&self) -> usize;
    fn new_cache(&self) -> Self::Cache;
    fn new_features(&self, layers: &[usize]) -> Self::Features;
    /// Forward `tokens` at positions `cache.len()..`, appending their keys and values to the cache and, when given,
    /// their features; the logits of `logit_rows` (indices into the block) are written to `logits`,
    /// `[logit_rows.len(), vocab]`.
    fn forward(&self, tokens: &[u32], cache: &mut Self::Cache, logit_rows: &[usize], features: Option<&mut Self::Features>, logits: &mut Vec<f32>) -> Result<()>;

    /// Forward several sequences' blocks, each as `forward` would alone, with one pass over the weights; `logits`
    /// gets every block's logit rows, block after block. A sequence's outputs must not depend on the blocks beside it
    /// where the engine's numerics allow (the CPU engine: bit for bit).
    fn forward_blocks(&self, blocks: &mut [Block<'_, Self>], logits: &mut Self::Logits) -> Result<()>;

    /// Feed drafts on the same weights (`SharedWeights::weights`) in one forward of their layer, each at its own
    /// positions of its own cache with its own feed; their head inputs, in order. A draft's row must not depend on
    /// the drafts beside it where the engine's numerics allow (the CPU engine: bit for bit).
    fn feed_together(&self, states: &mut [&mut Self::DraftState], feeds: &[Feed<'_, Self::Features>]) -> Result<Vec<Row<Self>>>;

    /// Feed the drafts `slots` (ascending indices into `drafts`) at one drafting position, each its own feed, and push
    /// their head inputs to `rows` in the same order: the drafts on the same weights as the first one with a state
    /// (`Draft::state`) together (`feed_together`: on a GPU at batch 64 one launch group a position instead of one
    /// a slot, on the CPU one pass over the weights), any other draft alone.
    fn feed_drafts(&self, drafts: &mut [&mut dyn Draft<Self>], slots: &[usize], feeds: &[Feed<'_, Self::Features>], rows: &mut Vec<Row<Self>>) -> Result<()>
    where
        Self: Sized,
    {
        let weights: Vec<Option<*const ()>> = slots.iter().map(|&i| drafts[i].state().map(|s| s.weights())).collect();
        let shared = weights.iter().flatten().next().copied();
        let mut fed: Vec<Option<Row<Self>>> = (0..slots.len()).map(|_| None).collect();
        let (mut states, mut which, mut together) = (Vec::new(), Vec::new(), Vec::new());
        for (i, draft) in drafts.iter_mut().enumerate() {
            if let Ok(j) = slots.binary_search(&i) {
                if weights[j].is_some() && weights[j] == shared {
                    states.push(draft.state().expect("has a state"));
                    which.push(j);
                    together.push(feeds[j]);
                }
            }
        }
        if !states.is_empty() {
            for (j, row) in which.into_iter().zip(self.feed_together(&mut states, &together)?) {
                fed[j] = Some(row);
            }
        }
        for (j, &i) in slots.iter().enumerate() {
            if fed[j].is_none() {
                fed[j] = Some(feeds[j].to(&mut *drafts[i])?);
            }
        }
        rows.extend(fed.into_iter().map(|row| row.expect("every slot fed")));
        Ok(())
    }
}

/// One sequence's share of a batched forward: what `TargetModel::forward` takes but the logits, which the batch
/// returns together.
pub struct Block<'a, T: TargetModel + ?Sized> {
    pub tokens: &'a [u32],
    pub cache: &'a mut T::Cache,
    pub logit_rows: &'a [usize],
    pub features: Option<&'a mut T::Features>,
}

/// Blocks laid end to end for one pass: every token, each block's row count, the blocks' logit rows as rows of the
/// whole batch, and the layers captured (those of the first block that asks; every block that asks must agree).
pub struct Batch {
    pub tokens: Vec<u32>,
    pub rows: Vec<usize>,
    pub logit_rows: Vec<usize>,
    pub capture: Vec<usize>,
}

impl Batch {
    /// `captured(features)`: the layers a block's features capture.
    pub fn of<T: TargetModel + ?Sized>(blocks: &[Block<'_, T>], captured: impl Fn(&T::Features) -> &[usize]) -> Result<Batch> {
        let capture = blocks.iter().find_map(|b| b.features.as_deref()).map_or(Vec::new(), |f| captured(f).to_vec());
        if blocks.iter().any(|b| b.features.as_deref().is_some_and(|f| captured(f) != capture)) {
            anyhow::bail!("the blocks of one forward capture different layers");
        }
        let mut batch = Batch { tokens: Vec::new(), rows: Vec::new(), logit_rows: Vec::new(), capture };
        for b in blocks {
            if let Some(&r) = b.logit_rows.iter().find(|&&r| r >= b.tokens.len()) {
                anyhow::bail!("logit row {r} is outside the block of {} tokens", b.tokens.len());
            }
            batch.logit_rows.extend(b.logit_rows.iter().map(|r| batch.tokens.len() + r));
            batch.tokens.extend_from_slice(b.tokens);
            batch.rows.push(b.tokens.len());
        }
        Ok(batch)
    }

    /// Hand each block its rows of the pass: `append(features, first row, rows)` adds them to its features.
    pub fn scatter<T: TargetModel + ?Sized>(blocks: &mut [Block<'_, T>], mut append: impl FnMut(&mut T::Features, usize, usize) -> Result<()>) -> Result<()> {
        let mut row = 0;
        for b in blocks.iter_mut() {
            let n = b.tokens.len();
            if let Some(f) = b.features.as_deref_mut() {
                append(f, row, n)?;
            }
            row += n;
        }
        Ok(())
    }
}

/// The rows of an LM head on one engine, and how a hidden row becomes logits over them.
pub trait HeadRows: Sized {
    /// A hidden row as this engine's drafts produce it.
    type Row;
    /// What computing logits may reuse between calls.
    type Scratch: Default;
    fn rows(&self) -> usize;
    /// The head made of `rows` (in that order), gathered once.
    fn select_rows(&self, rows: &[u32]) -> Result<Self>;
    /// Logits of `row` over every row of the head, on the host.
    fn logits(&self, row: &Self::Row, out: &mut Vec<f32>, scratch: &mut Self::Scratch) -> Result<()>;
    /// The row with the largest logit: by default through `logits` on the host (the lowest index wins a tie); an
    /// engine may find it where the logits are and bring back one index.
    fn argmax(&self, row: &Self::Row, logits: &mut Vec<f32>, scratch: &mut Self::Scratch) -> Result<usize> {
        self.logits(row, logits, scratch)?;
        Ok(crate::sampling::argmax(logits) as usize)
    }
    /// `logits` of several rows, each into its own `out`: one product, so the head is read once for all of them
    /// (sequences drafting through one head side by side). Each row's logits are what `logits` gives it alone on
    /// an engine whose products do not depend on their neighbours.
    fn logits_many(&self, rows: &[&Self::Row], out: &mut [&mut Vec<f32>], scratch: &mut Self::Scratch) -> Result<()> {
        for (row, out) in rows.iter().zip(out.iter_mut()) {
            self.logits(row, out, scratch)?;
        }
        Ok(())
    }
    /// `argmax` of several rows into `indices`, as `logits_many`.
    fn argmax_many(&self, rows: &[&Self::Row], logits: &mut [&mut Vec<f32>], scratch: &mut Self::Scratch, indices: &mut Vec<usize>) -> Result<()> {
        self.logits_many(rows, logits, scratch)?;
        indices.clear();
        indices.extend(logits.iter().map(|l| crate::sampling::argmax(l) as usize));
        Ok(())
    }
    /// A hidden row of the head's own width, for timing it (the values do not change the time).
    fn probe(&self) -> Result<Self::Row>;
    /// Whether `other` holds the same rows, so that heads sliced from the two can be served by one product (the
    /// CPU engine). No by default: an engine whose logits stay on its device would gather them there instead.
    fn shares_rows_with(&self, _other: &Self) -> bool {
        false
    }
}

/// The hidden row type of a target's heads.
pub type Row<T> = <<T as TargetModel>::Head as HeadRows>::Row;
