//! The speculative core, written once for every engine: the draft-verify loop with its counters, the T = 0 fast
//! path, target-only generation, and FR-Spec's pruned draft heads. It knows engines only through the traits below:
//! a target forwards token blocks over a cache that rolls back and returns the logits rows the loop asks for to the
//! host, while its captured features stay on the engine's device; a draft catches up on accepted tokens and
//! proposes through an LM head whose kept rows live on that device too.
//!
//! Engines: `engine::cpu` (frspec's bit-exact kernels) and `engine::candle` (candle tensors on the CPU or a GPU).

pub mod decode;
pub mod draft;
pub mod generate;

pub use decode::{greedy_turns, speculative_turn, SpecConfig, TurnRecord};
pub use draft::{Chooser, Context, Draft, DraftHead, DraftKind, DraftMode, HeadMode, LmHead, Proposal};
pub use generate::{generate, Generation, StopReason};

use anyhow::Result;

/// Per-sequence state indexed by position (a KV cache, captured features) that rolls back to a prefix.
pub trait Positions {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget positions `len..` (rejected drafts).
    fn truncate(&mut self, len: usize) -> Result<()>;
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

    fn vocab(&self) -> usize;
    fn context_length(&self) -> usize;
    fn new_cache(&self) -> Self::Cache;
    fn new_features(&self, layers: &[usize]) -> Self::Features;
    /// Forward `tokens` at positions `cache.len()..`, appending their keys and values to the cache and, when given,
    /// their features; the logits of `logit_rows` (indices into the block) are written to `logits`,
    /// `[logit_rows.len(), vocab]`.
    fn forward(&self, tokens: &[u32], cache: &mut Self::Cache, logit_rows: &[usize], features: Option<&mut Self::Features>, logits: &mut Vec<f32>) -> Result<()>;
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
    /// A hidden row of the head's own width, for timing it (the values do not change the time).
    fn probe(&self) -> Result<Self::Row>;
}

/// The hidden row type of a target's heads.
pub type Row<T> = <<T as TargetModel>::Head as HeadRows>::Row;
