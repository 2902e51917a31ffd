//! frspec's own engine: the Llama forward on its CPU kernels (`model`, `tensor`), the drafts on it (`draft`), and
//! the speculative core's traits for them. Every output is one dot product in a fixed order, so a block of tokens
//! gives bit for bit what single steps give, and a sequence in a batch what it gets alone.

pub mod draft;
pub mod exp;
pub mod kquants;
pub mod model;
pub mod q8;
pub mod tensor;

use crate::speculative::{Batch, Block, Feed, HeadRows, HostLogits, Positions, TargetModel};
use anyhow::{bail, Result};
use model::{Cache, Model};
use std::sync::Arc;
use tensor::{MatmulScratch, Matrix};

/// One sequence's captured features on the host: post-norm hidden states `[n, hidden]` and the inputs of the
/// captured layers, concatenated per position `[n, layers · hidden]`.
#[derive(Clone, Debug, Default)]
pub struct CpuFeatures {
    pub hidden: Vec<f32>,
    pub layers: Vec<f32>,
    capture: Vec<usize>,
    width: usize,
}

impl CpuFeatures {
    pub fn new(hidden: usize, capture: &[usize]) -> CpuFeatures {
        CpuFeatures { hidden: Vec::new(), layers: Vec::new(), capture: capture.to_vec(), width: hidden }
    }

    /// Features without captured layers, from post-norm hidden states `[n, hidden]`.
    pub fn from_hidden(hidden: Vec<f32>, width: usize) -> CpuFeatures {
        CpuFeatures { hidden, layers: Vec::new(), capture: Vec::new(), width }
    }

    /// Append positions: their hidden rows and, for each captured layer in order, its rows (`[n, hidden]` each).
    pub fn append<L: AsRef<[f32]>>(&mut self, hidden: &[f32], per_layer: &[L]) {
        self.hidden.extend_from_slice(hidden);
        let h = self.width;
        for i in 0..hidden.len() / h {
            for layer in per_layer {
                self.layers.extend_from_slice(&layer.as_ref()[i * h..(i + 1) * h]);
            }
        }
    }

    /// The layers whose inputs are captured.
    pub fn captured(&self) -> &[usize] {
        &self.capture
    }
}

impl Positions for CpuFeatures {
    fn len(&self) -> usize {
        self.hidden.len() / self.width
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.hidden.truncate(len * self.width);
        self.layers.truncate(len * self.width * self.capture.len());
        Ok(())
    }

    fn copy_prefix(&mut self, from: &CpuFeatures, len: usize) -> Result<()> {
        if (from.width, &from.capture) != (self.width, &self.capture) {
            bail!("features of layers {:?} cannot start from features of layers {:?}", self.capture, from.capture);
        }
        if len > from.len() {
            bail!("a prefix of {len} positions asked of features holding {}", from.len());
        }
        self.hidden.clear();
        self.hidden.extend_from_slice(&from.hidden[..len * self.width]);
        self.layers.clear();
        self.layers.extend_from_slice(&from.layers[..len * self.width * self.capture.len()]);
        Ok(())
    }
}

impl Positions for Cache {
    fn len(&self) -> usize {
        Cache::len(self)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        Cache::truncate(self, len);
        Ok(())
    }

    fn copy_prefix(&mut self, from: &Cache, len: usize) -> Result<()> {
        Cache::copy_prefix(self, from, len)
    }
}

impl TargetModel for Model {
    type Cache = Cache;
    type Features = CpuFeatures;
    type DraftState = draft::DraftState;
    type Logits = HostLogits;
    type Head = Arc<Matrix>;

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn context_length(&self) -> usize {
        self.config.context_length
    }

    fn new_cache(&self) -> Cache {
        Model::new_cache(self)
    }

    fn new_features(&self, layers: &[usize]) -> CpuFeatures {
        CpuFeatures::new(self.config.hidden, layers)
    }

    fn forward(&self, tokens: &[u32], cache: &mut Cache, logit_rows: &[usize], features: Option<&mut CpuFeatures>, logits: &mut Vec<f32>) -> Result<()> {
        let capture = features.as_ref().map_or(&[][..], |f| f.captured());
        let mut fwd = self.forward_sequences_reusing(tokens, &mut [&mut *cache], &[tokens.len()], logit_rows, capture, std::mem::take(logits))?;
        if let Some(f) = features {
            f.append(&fwd.hidden, &fwd.layer_inputs);
        }
        *logits = std::mem::take(&mut fwd.logits);
        cache.recycle(fwd);
        Ok(())
    }

    /// EAGLE drafts on the same weights through their layer in one pass over its weights (`draft::feed_together`).
    fn feed_together(&self, states: &mut [&mut draft::DraftState], feeds: &[Feed<'_, CpuFeatures>]) -> Result<Vec<Vec<f32>>> {
        draft::feed_together(self, states, feeds)
    }

    /// Every block in one pass (`Model::forward_sequences`).
    fn forward_blocks(&self, blocks: &mut [Block<'_, Self>], logits: &mut HostLogits) -> Result<()> {
        let batch = Batch::of(blocks, |f| f.captured())?;
        let mut caches: Vec<&mut Cache> = blocks.iter_mut().map(|b| &mut *b.cache).collect();
        let mut fwd = self.forward_sequences_reusing(&batch.tokens, &mut caches, &batch.rows, &batch.logit_rows, &batch.capture, logits.take_rows())?;
        let h = self.config.hidden;
        logits.fill(std::mem::take(&mut fwd.logits), self.config.vocab);
        Batch::scatter(blocks, |f, row, n| {
            let captured: Vec<&[f32]> = fwd.layer_inputs.iter().map(|l| &l[row * h..(row + n) * h]).collect();
            f.append(&fwd.hidden[row * h..(row + n) * h], &captured);
            Ok(())
        })?;
        blocks[0].cache.recycle(fwd);
        Ok(())
    }
}

/// What a CPU head's products reuse: the matmul's buffers, and the stacked rows and logits of `logits_many`.
#[derive(Default)]
pub struct HeadScratch {
    matmul: MatmulScratch,
    rows: Vec<f32>,
    logits: Vec<f32>,
}

impl HeadRows for Arc<Matrix> {
    type Row = Vec<f32>;
    type Scratch = HeadScratch;

    fn rows(&self) -> usize {
        self.rows
    }

    fn select_rows(&self, rows: &[u32]) -> Result<Arc<Matrix>> {
        Ok(Arc::new(Matrix::select_rows(self, rows)))
    }

    fn logits(&self, row: &Vec<f32>, out: &mut Vec<f32>, scratch: &mut HeadScratch) -> Result<()> {
        out.resize(self.rows, 0.0);
        self.matmul(row, out, &mut scratch.matmul);
        Ok(())
    }

    /// The rows stacked into one product (each weight row unpacked once for up to 8 of them); a row's logits are
    /// its logits alone, bit for bit (`Matrix::matmul`).
    fn logits_many(&self, rows: &[&Vec<f32>], out: &mut [&mut Vec<f32>], scratch: &mut HeadScratch) -> Result<()> {
        if let ([row], [out]) = (rows, &mut *out) {
            return self.logits(row, out, scratch);
        }
        scratch.rows.clear();
        rows.iter().for_each(|r| scratch.rows.extend_from_slice(r));
        scratch.logits.resize(rows.len() * self.rows, 0.0);
        self.matmul(&scratch.rows, &mut scratch.logits, &mut scratch.matmul);
        for (out, logits) in out.iter_mut().zip(scratch.logits.chunks_exact(self.rows)) {
            out.clear();
            out.extend_from_slice(logits);
        }
        Ok(())
    }

    fn probe(&self) -> Result<Vec<f32>> {
        Ok(vec![0.5; self.cols])
    }

    fn shares_rows_with(&self, other: &Arc<Matrix>) -> bool {
        Arc::ptr_eq(self, other)
    }
}
