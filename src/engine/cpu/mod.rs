//! frspec's own engine: the Llama forward on its CPU kernels (`model`, `tensor`), the drafts on it (`draft`), and
//! the speculative core's traits for them. Every output is one dot product in a fixed order, so a block of tokens
//! gives bit for bit what single steps give, and a sequence in a batch what it gets alone.

pub mod draft;
pub mod model;
pub mod tensor;

use crate::speculative::decode::{continuation_stop, Continuation};
use crate::speculative::{HeadRows, Positions, StopReason, TargetModel};
use anyhow::{bail, Result};
use model::{Cache, Model};
use std::sync::Arc;
use std::time::Instant;
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
}

impl Positions for Cache {
    fn len(&self) -> usize {
        Cache::len(self)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        Cache::truncate(self, len);
        Ok(())
    }
}

impl TargetModel for Model {
    type Cache = Cache;
    type Features = CpuFeatures;
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
        let fwd = Model::forward(self, tokens, cache, logit_rows, capture)?;
        if let Some(f) = features {
            f.append(&fwd.hidden, &fwd.layer_inputs);
        }
        *logits = fwd.logits;
        Ok(())
    }
}

impl HeadRows for Arc<Matrix> {
    type Row = Vec<f32>;
    type Scratch = MatmulScratch;

    fn rows(&self) -> usize {
        self.rows
    }

    fn select_rows(&self, rows: &[u32]) -> Result<Arc<Matrix>> {
        Ok(Arc::new(Matrix::select_rows(self, rows)))
    }

    fn logits(&self, row: &Vec<f32>, out: &mut Vec<f32>, scratch: &mut MatmulScratch) -> Result<()> {
        out.resize(self.rows, 0.0);
        self.matmul(row, out, scratch);
        Ok(())
    }

    fn probe(&self) -> Result<Vec<f32>> {
        Ok(vec![0.5; self.cols])
    }
}

/// Greedy continuations of several prompts decoded together: each prompt is prefilled alone, then each step
/// forwards the newest token of every unfinished sequence as one block (`Model::forward_batch`), so a step's pass
/// over the weights serves them all. Each continuation is what the prompt gets alone, bit for bit; `secs` is the
/// call's wall time shared equally.
pub fn greedy_continuations<P: AsRef<[u32]>>(target: &Model, stop_ids: &[u32], prompts: &[P], max_new_tokens: usize, layers: &[usize]) -> Result<Vec<Continuation<CpuFeatures>>> {
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
) -> Result<Vec<Continuation<CpuFeatures>>> {
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
        let mut features = CpuFeatures::new(target.config.hidden, layers);
        let fwd = target.forward(prompt, &mut cache, &[prompt.len() - 1], layers)?;
        let next = choose(i, &fwd.logits);
        features.append(&fwd.hidden, &fwd.layer_inputs);
        seqs.push((Continuation { tokens: prompt.to_vec(), features, stop: StopReason::MaxTokens, secs: 0.0 }, next));
        caches.push(cache);
    }
    let (h, mut active): (usize, Vec<usize>) = (target.config.hidden, (0..prompts.len()).collect());
    let mut tokens = Vec::with_capacity(prompts.len());
    while !active.is_empty() {
        // Take each sequence's next token; those that stop leave the batch.
        active.retain(|&i| {
            let (c, next) = &mut seqs[i];
            c.tokens.push(*next);
            let stop = continuation_stop(*next, stop_ids, c.tokens.len() - prompts[i].len(), max_new_tokens, caches[i].len(), ctx_limit);
            c.stop = stop.unwrap_or(c.stop);
            stop.is_none()
        });
        if active.is_empty() {
            break;
        }
        tokens.clear();
        tokens.extend(active.iter().map(|&i| seqs[i].1));
        let mut batch: Vec<&mut Cache> = caches.iter_mut().enumerate().filter(|(i, _)| active.binary_search(i).is_ok()).map(|(_, c)| c).collect();
        let fwd = target.forward_batch(&tokens, &mut batch, layers)?;
        for (row, &i) in active.iter().enumerate() {
            let (c, next) = &mut seqs[i];
            let captured: Vec<&[f32]> = fwd.layer_inputs.iter().map(|l| &l[row * h..(row + 1) * h]).collect();
            c.features.append(&fwd.hidden[row * h..(row + 1) * h], &captured);
            *next = choose(i, &fwd.logits[row * target.config.vocab..(row + 1) * target.config.vocab]);
        }
    }
    let secs = t0.elapsed().as_secs_f64() / prompts.len() as f64;
    Ok(seqs.into_iter().map(|(c, _)| Continuation { secs, ..c }).collect())
}

