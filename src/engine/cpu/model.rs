//! The target model: Llama-family decoder (Llama 2/3/3.1, SmolLM2, Qwen2) on CPU.
//!
//! `forward` takes a block of new tokens at the cache's current length and returns, for every position of the
//! block, the hidden state after the final norm (the LM-head input, which EAGLE drafts are fed), optionally the
//! hidden states entering chosen layers (EAGLE-3), and logits only for the rows asked for. Every position is
//! computed with the same arithmetic whether it arrives alone or in a block, so speculative verification of k+1
//! tokens reproduces k+1 single-token steps bit for bit (tested).

use crate::engine::cpu::exp::exp_in_place;
use crate::engine::cpu::tensor::{dots_strided, pool, weighted_rows, Matrix, MatmulScratch};
use crate::loading::weights::{Gguf, Safetensors, WeightSource};
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;

/// Which pairs of a head's dimensions RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF llama files, whose Q/K rows the converter permuted.
    Interleaved,
    /// Halves (i, i + d/2): HF checkpoints and GGUF qwen2 (NeoX style).
    Halves,
}

/// Llama-3.1's frequency-dependent RoPE rescaling.
#[derive(Clone, Debug, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub architecture: String,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub context_length: usize,
    /// Whether the LM head may be the embedding (GGUF files omit `output.weight` then; HF configs say so).
    pub tied_embeddings: bool,
}

/// One Llama decoder layer. EAGLE-1's layer has no input norm (its input is already a projection).
pub struct Layer {
    pub attn_norm: Option<Vec<f32>>,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub ffn_norm: Vec<f32>,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Layer {
    /// The layer's seven weight matrices.
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        [&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down].into_iter().map(|l| &l.weight)
    }
}

/// A weight matrix with an optional bias (Qwen2's Q/K/V projections carry one).
pub struct Linear {
    pub weight: Matrix,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn forward(&self, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        Linear::forward_many(x, [(self, out)], scratch)
    }

    /// Several projections of the same input in one parallel region (`Matrix::matmul_many`).
    pub fn forward_many<const K: usize>(x: &[f32], projections: [(&Linear, &mut [f32]); K], scratch: &mut MatmulScratch) {
        let linears = projections.each_ref().map(|(l, _)| *l);
        let mut products = projections.map(|(l, out)| (&l.weight, out));
        Matrix::matmul_many(x, &mut products, scratch);
        for ((_, out), l) in products.iter_mut().zip(linears) {
            if let Some(b) = &l.bias {
                for row in out.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
                }
            }
        }
    }
}

/// The shapes and constants a decoder layer needs, shared by the target and by EAGLE heads.
#[derive(Clone, Debug)]
pub struct Geometry {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_style: RopeStyle,
    pub inv_freq: Vec<f32>,
}

impl Geometry {
    pub fn new(c: &Config, rope_freqs: Option<&[f32]>) -> Geometry {
        Geometry {
            hidden: c.hidden,
            intermediate: c.intermediate,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            rms_eps: c.rms_eps,
            rope_style: c.rope_style,
            inv_freq: inverse_frequencies(c, rope_freqs),
        }
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// cos/sin of every rotated pair for each row's position, `[rows, head_dim / 2]`.
    fn rope_tables(&self, positions: impl Iterator<Item = usize>, w: &mut Workspace) {
        w.cos.clear();
        w.sin.clear();
        for pos in positions {
            let pos = pos as f32;
            for f in &self.inv_freq {
                // The angle is formed in f32 as HF transformers does; cos/sin themselves are evaluated exactly.
                let angle = (pos * f) as f64;
                w.cos.push(angle.cos() as f32);
                w.sin.push(angle.sin() as f32);
            }
        }
    }

    fn rope(&self, x: &mut [f32], cos: &[f32], sin: &[f32], row: usize) {
        let d = self.head_dim;
        let half = d / 2;
        let (cos, sin) = (&cos[row * half..(row + 1) * half], &sin[row * half..(row + 1) * half]);
        for head in x.chunks_exact_mut(d) {
            for j in 0..half {
                let (a, b) = match self.rope_style {
                    RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                    RopeStyle::Halves => (j, j + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[j] - x1 * sin[j];
                head[b] = x1 * cos[j] + x0 * sin[j];
            }
        }
    }

    /// Causal attention of one query head (`q`, head_dim wide) over the first `visible` positions of the cache, into
    /// `out`. Keys are visited in position order, so the result does not depend on how positions were grouped.
    fn attend(&self, q: &[f32], kv: &LayerCache, visible: usize, kv_head: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
        let (d, kvd) = (self.head_dim, self.kv_width());
        let scale = 1.0 / (d as f32).sqrt();
        scores.resize(visible, 0.0);
        dots_strided(q, &kv.keys[kv_head * d..], kvd, scores);
        let mut max = f32::NEG_INFINITY;
        for s in scores.iter_mut() {
            *s *= scale;
            max = max.max(*s);
        }
        scores.iter_mut().for_each(|s| *s -= max);
        exp_in_place(scores);
        let sum = scores.iter().fold(0f32, |sum, s| sum + s);
        scores.iter_mut().for_each(|s| *s /= sum);
        weighted_rows(scores, &kv.values[kv_head * d..], kvd, out);
    }

    /// Causal attention of every query head of the block's rows, each sequence's rows over its own cache
    /// (`segments`: the cache, its length before the block, the block row the sequence starts at, its rows): one task
    /// per (row, head) on the pool, each computed as `attend` computes it alone.
    fn attention(&self, q: &[f32], segments: &[(&LayerCache, usize, usize, usize)], out: &mut [f32]) {
        thread_local! {
            static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let (d, group) = (self.head_dim, self.heads / self.kv_heads);
        let task = |(i, out): (usize, &mut [f32])| {
            let (row, h) = (i / self.heads, i % self.heads);
            let &(kv, start, first, _) = segments.iter().find(|&&(_, _, first, rows)| row < first + rows).expect("a segment holds every row");
            SCORES.with_borrow_mut(|scores| self.attend(&q[i * d..(i + 1) * d], kv, start + row - first + 1, h / group, scores, out));
        };
        // Below some 64k products (a few tens of µs) handing tasks to the pool costs more than it saves.
        // Row r of a segment sees start + r + 1 positions.
        let products = segments.iter().map(|&(_, start, _, rows)| rows * start + rows * (rows + 1) / 2).sum::<usize>() * self.heads * d;
        match products < 1 << 16 {
            true => out.chunks_mut(d).enumerate().for_each(task),
            false => pool().install(|| out.par_chunks_mut(d).enumerate().for_each(task)),
        }
    }
}

/// Consecutive rows of a block that continue one sequence: the layer's cache they extend, and its length before.
struct Segment<'c> {
    kv: &'c mut LayerCache,
    start: usize,
    rows: usize,
}

impl Layer {
    /// Advance the residual stream `x` (`[n, hidden]`) through this layer; its rows continue the `segments`'
    /// sequences in order, and each segment's keys and values are appended to its cache. `w.cos`/`w.sin` must hold
    /// the rope tables for the rows' positions. `attn_input` replaces the attention's input (EAGLE-3 attends over
    /// [embedding; hidden], 2·hidden wide).
    fn forward<'c>(&self, g: &Geometry, x: &mut [f32], attn_input: Option<&[f32]>, segments: impl Iterator<Item = Segment<'c>>, w: &mut Workspace) {
        let n = x.len() / g.hidden;
        let (h, qd, kvd) = (g.hidden, g.heads * g.head_dim, g.kv_width());
        w.normed.resize(n * h, 0.0);
        w.q.resize(n * qd, 0.0);
        w.k.resize(n * kvd, 0.0);
        w.v.resize(n * kvd, 0.0);
        w.attn.resize(n * qd, 0.0);
        w.proj.resize(n * h, 0.0);
        w.gate.resize(n * g.intermediate, 0.0);
        w.up.resize(n * g.intermediate, 0.0);
        let attn_in: &[f32] = match (attn_input, &self.attn_norm) {
            (Some(input), _) => input,
            (None, Some(norm)) => {
                rms_norm(x, norm, g.rms_eps, &mut w.normed);
                &w.normed
            }
            (None, None) => x,
        };
        Linear::forward_many(attn_in, [(&self.q, &mut w.q[..]), (&self.k, &mut w.k[..]), (&self.v, &mut w.v[..])], &mut w.matmul.0);
        for i in 0..n {
            g.rope(&mut w.q[i * qd..(i + 1) * qd], &w.cos, &w.sin, i);
            g.rope(&mut w.k[i * kvd..(i + 1) * kvd], &w.cos, &w.sin, i);
        }
        // Each sequence attends over its own cache only.
        let mut row = 0;
        let caches: Vec<(&LayerCache, usize, usize, usize)> = segments
            .map(|s| {
                let rows = row..row + s.rows;
                s.kv.keys.extend_from_slice(&w.k[rows.start * kvd..rows.end * kvd]);
                s.kv.values.extend_from_slice(&w.v[rows.start * kvd..rows.end * kvd]);
                row = rows.end;
                (&*s.kv, s.start, rows.start, s.rows)
            })
            .collect();
        g.attention(&w.q, &caches, &mut w.attn);
        self.o.forward(&w.attn, &mut w.proj, &mut w.matmul.0);
        x.iter_mut().zip(&w.proj).for_each(|(x, p)| *x += p);

        rms_norm(x, &self.ffn_norm, g.rms_eps, &mut w.normed);
        Linear::forward_many(&w.normed, [(&self.gate, &mut w.gate[..]), (&self.up, &mut w.up[..])], &mut w.matmul.0);
        gate_in_place(&mut w.gate, &w.up);
        self.down.forward(&w.gate, &mut w.proj, &mut w.matmul.0);
        x.iter_mut().zip(&w.proj).for_each(|(x, p)| *x += p);
    }
}

pub struct Model {
    pub config: Config,
    pub geometry: Geometry,
    embed: Arc<Matrix>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// None when the LM head is tied to the embedding.
    lm_head: Option<Arc<Matrix>>,
}

/// What one forward pass returns.
#[derive(Default, Debug)]
pub struct Forward {
    /// `[n, hidden]`: each position's last-layer output after the final norm.
    pub hidden: Vec<f32>,
    /// `[rows.len(), vocab]`: logits for the block rows that were asked for, in that order.
    pub logits: Vec<f32>,
    /// For each requested layer index, `[n, hidden]`: the residual stream entering that layer.
    pub layer_inputs: Vec<Vec<f32>>,
}

/// One layer's keys and values, `[position][kv_head][head_dim]`.
#[derive(Clone, Default)]
pub struct LayerCache {
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl LayerCache {
    fn truncate(&mut self, len: usize, kv_width: usize) {
        self.keys.truncate(len * kv_width);
        self.values.truncate(len * kv_width);
    }

    fn copy_prefix(&mut self, from: &LayerCache, len: usize, kv_width: usize) {
        self.keys.clear();
        self.keys.extend_from_slice(&from.keys[..len * kv_width]);
        self.values.clear();
        self.values.extend_from_slice(&from.values[..len * kv_width]);
    }
}

/// Keys and values of every layer plus the buffers a forward pass reuses.
#[derive(Clone)]
pub struct Cache {
    layers: Vec<LayerCache>,
    len: usize,
    kv_width: usize,
    work: Workspace,
}

/// Scratch buffers of a forward pass, kept between calls so decoding does not allocate per token.
#[derive(Clone, Default)]
pub struct Workspace {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    matmul: MatmulScratchCell,
    /// The rows the LM head is asked for, side by side.
    picked: Vec<f32>,
    /// A returned forward's hidden rows and captured layers (`Cache::recycle`), for the next forward to write over.
    hidden: Vec<f32>,
    layer_inputs: Vec<Vec<f32>>,
}

/// `MatmulScratch` is not `Clone` (nothing in it is worth copying); a cloned cache starts with empty scratch.
#[derive(Default)]
struct MatmulScratchCell(MatmulScratch);

impl Clone for MatmulScratchCell {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl Cache {
    /// An empty cache for `layers` layers of this geometry.
    pub fn new(layers: usize, g: &Geometry) -> Cache {
        Cache { layers: vec![LayerCache::default(); layers], len: 0, kv_width: g.kv_width(), work: Workspace::default() }
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drop every position from `len` on (rejected speculative tokens). The kept prefix is not copied.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            for l in &mut self.layers {
                l.truncate(len, self.kv_width);
            }
        }
    }

    /// Hold the first `len` positions of `from`, a cache of the same model, in this cache's own buffers.
    pub fn copy_prefix(&mut self, from: &Cache, len: usize) -> Result<()> {
        if (from.layers.len(), from.kv_width) != (self.layers.len(), self.kv_width) {
            bail!("a cache of {} layers of width {} cannot start from one of {} layers of width {}", self.layers.len(), self.kv_width, from.layers.len(), from.kv_width);
        }
        if len > from.len {
            bail!("a prefix of {len} positions asked of a cache holding {}", from.len);
        }
        for (mine, theirs) in self.layers.iter_mut().zip(&from.layers) {
            mine.copy_prefix(theirs, len, self.kv_width);
        }
        self.len = len;
        Ok(())
    }

    /// Run `layers` over the residual stream `x` (`[n, hidden]`) at positions `len()..`, appending to the cache.
    /// `first_attn_input` replaces the first layer's attention input; `capture(i, x)` sees the stream entering
    /// layer i.
    pub fn advance(&mut self, g: &Geometry, layers: &[Layer], x: &mut [f32], first_attn_input: Option<&[f32]>, capture: impl FnMut(usize, &[f32])) {
        let n = x.len() / g.hidden;
        advance_sequences(g, layers, &mut [self], &[n], x, first_attn_input, capture);
    }

    /// The scratch a caller may use for its own matmuls between forwards.
    pub fn matmul_scratch(&mut self) -> &mut MatmulScratch {
        &mut self.work.matmul.0
    }

    /// Hand back the hidden rows and captured layers of a forward whose first sequence this cache was, once read:
    /// the next forward writes over them instead of allocating (they were `[rows, hidden]` each, every step).
    pub fn recycle(&mut self, used: Forward) {
        (self.work.hidden, self.work.layer_inputs) = (used.hidden, used.layer_inputs);
    }
}

/// `Cache::advance` for several sequences in one pass over the layers' weights: `x` holds `rows[i]` rows continuing
/// `caches[i]`, in order, and each sequence attends over its own cache only, so its rows are what it gets alone, bit
/// for bit. The first cache's buffers serve every sequence.
pub fn advance_sequences(
    g: &Geometry,
    layers: &[Layer],
    caches: &mut [&mut Cache],
    rows: &[usize],
    x: &mut [f32],
    first_attn_input: Option<&[f32]>,
    mut capture: impl FnMut(usize, &[f32]),
) {
    let mut work = std::mem::take(&mut caches[0].work);
    g.rope_tables(caches.iter().zip(rows).flat_map(|(k, &per)| k.len..k.len + per), &mut work);
    for (i, layer) in layers.iter().enumerate() {
        capture(i, x);
        let segments = caches.iter_mut().zip(rows).map(|(k, &rows)| Segment { start: k.len, kv: &mut k.layers[i], rows });
        layer.forward(g, x, if i == 0 { first_attn_input } else { None }, segments, &mut work);
    }
    caches.iter_mut().zip(rows).for_each(|(k, &per)| k.len += per);
    caches[0].work = work;
}

impl Model {
    /// Load from a `.gguf` file, a `.safetensors` file or a folder holding config.json and safetensors.
    pub fn load(path: &Path) -> Result<Model> {
        if !path.exists() {
            bail!("model file {} does not exist", path.display());
        }
        if path.extension().is_some_and(|e| e == "gguf") {
            let gguf = Gguf::open(path)?;
            let config = gguf_config(&gguf)?;
            Model::build(config, &gguf)
        } else {
            let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
            let config = hf_config(&dir.join("config.json"))?;
            let st = Safetensors::open(path)?;
            Model::build(config, &st)
        }
    }

    /// Build from any weight source whose tensors follow the GGUF llama naming.
    pub fn build(config: Config, src: &dyn WeightSource) -> Result<Model> {
        let c = &config;
        let layers = (0..c.layers).map(|i| load_layer(src, c, &format!("blk.{i}"), true)).collect::<Result<Vec<_>>>()?;
        let embed = Arc::new(load_linear(src, "token_embd", c.vocab, c.hidden)?.weight);
        let lm_head = if src.contains("output.weight") {
            Some(Arc::new(load_linear(src, "output", c.vocab, c.hidden)?.weight))
        } else if c.tied_embeddings {
            None
        } else {
            bail!("{}: the model has no LM head (lm_head.weight is missing and the embeddings are not tied)", src.path().display());
        };
        let rope_freqs = if src.contains("rope_freqs.weight") { Some(src.vector("rope_freqs.weight")?) } else { None };
        let geometry = Geometry::new(c, rope_freqs.as_deref());
        let norm = load_norm(src, "output_norm.weight", c.hidden)?;
        Ok(Model { config, geometry, embed, layers, norm, lm_head })
    }

    /// Bytes the weights occupy in memory: every matrix in its storage, norms as f32 (a tied head counted once).
    pub fn weight_bytes(&self) -> usize {
        let norms = self.norm.len() + self.layers.iter().map(|l| l.ffn_norm.len() + l.attn_norm.as_ref().map_or(0, Vec::len)).sum::<usize>();
        let matrices: usize = self.layers.iter().flat_map(Layer::matrices).map(Matrix::bytes).sum();
        matrices + self.embed.bytes() + self.lm_head.as_ref().map_or(0, |h| h.bytes()) + 4 * norms
    }

    /// How many matrices (embedding and LM head included) each weight type has.
    pub fn weight_types(&self) -> std::collections::BTreeMap<&'static str, usize> {
        let mut counts = std::collections::BTreeMap::new();
        let head = self.lm_head.as_deref();
        for m in self.layers.iter().flat_map(Layer::matrices).chain([&*self.embed]).chain(head) {
            *counts.entry(m.dtype_name()).or_insert(0) += 1;
        }
        counts
    }

    pub fn embedding(&self) -> &Matrix {
        &self.embed
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The final norm's weights.
    pub fn norm(&self) -> &[f32] {
        &self.norm
    }

    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The LM head, shared (drafts slice it or reuse it without copying).
    pub fn lm_head_shared(&self) -> Arc<Matrix> {
        self.lm_head.as_ref().unwrap_or(&self.embed).clone()
    }

    /// Keep only the first `n` layers (a truncated copy of the target is a real, if weak, draft model).
    pub fn truncate_layers(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > self.layers.len() {
            bail!("cannot keep {n} layers of a model with {}", self.layers.len());
        }
        self.layers.truncate(n);
        self.config.layers = n;
        Ok(())
    }

    pub fn new_cache(&self) -> Cache {
        Cache::new(self.config.layers, &self.geometry)
    }

    /// Embedding rows of `tokens`, `[n, hidden]`.
    pub fn embed_into(&self, tokens: &[u32], out: &mut Vec<f32>) -> Result<()> {
        let h = self.config.hidden;
        out.resize(tokens.len() * h, 0.0);
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(h)) {
            if t as usize >= self.config.vocab {
                bail!("token id {t} is outside the model's vocabulary of {}", self.config.vocab);
            }
            self.embed.row_into(t as usize, row);
        }
        Ok(())
    }

    /// Forward `tokens` at positions `cache.len()..`, appending their keys and values to the cache.
    /// `logit_rows` are indices into the block; `capture_layers` are layer indices whose inputs to return.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache, logit_rows: &[usize], capture_layers: &[usize]) -> Result<Forward> {
        self.forward_sequences(tokens, &mut [cache], &[tokens.len()], logit_rows, capture_layers)
    }

    /// Forward one token for each of several sequences at once, `tokens[i]` at position `caches[i].len()`, with
    /// logits for every row (`forward_sequences` with one row each).
    pub fn forward_batch(&self, tokens: &[u32], caches: &mut [&mut Cache], capture_layers: &[usize]) -> Result<Forward> {
        if tokens.len() != caches.len() {
            bail!("a batched forward takes one token per sequence ({} tokens for {} caches)", tokens.len(), caches.len());
        }
        let rows: Vec<usize> = (0..tokens.len()).collect();
        self.forward_sequences(tokens, caches, &vec![1; tokens.len()], &rows, capture_layers)
    }

    /// Forward blocks of several sequences in one pass over the weights: `tokens` holds `rows[i]` tokens continuing
    /// `caches[i]`, in order; attention runs per sequence over its own cache. `logit_rows` index the whole batch.
    /// Each sequence's outputs are what `forward` gives it alone, bit for bit: every output is one dot product in
    /// a fixed order, whatever the rows beside it.
    pub fn forward_sequences(&self, tokens: &[u32], caches: &mut [&mut Cache], rows: &[usize], logit_rows: &[usize], capture_layers: &[usize]) -> Result<Forward> {
        self.forward_sequences_reusing(tokens, caches, rows, logit_rows, capture_layers, Vec::new())
    }

    /// `forward_sequences` writing the logits over `logits`, a buffer an earlier forward returned: a batch's logit
    /// rows (80 × 49,152 for 16 SmolLM2 verification blocks) were a fresh zeroed allocation every step.
    pub fn forward_sequences_reusing(&self, tokens: &[u32], caches: &mut [&mut Cache], rows: &[usize], logit_rows: &[usize], capture_layers: &[usize], logits: Vec<f32>) -> Result<Forward> {
        crate::engine::cpu::tensor::with_pool_awake(|| self.forward_in_pool(tokens, caches, rows, logit_rows, capture_layers, logits))
    }

    fn forward_in_pool(&self, tokens: &[u32], caches: &mut [&mut Cache], rows: &[usize], logit_rows: &[usize], capture_layers: &[usize], mut logits: Vec<f32>) -> Result<Forward> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            bail!("forward called with no tokens");
        }
        if rows.len() != caches.len() || rows.iter().sum::<usize>() != n {
            bail!("{n} tokens do not split into blocks of {rows:?} rows for {} sequences", caches.len());
        }
        if let Some((full, per)) = caches.iter().zip(rows).find(|(k, &per)| k.len + per > c.context_length) {
            bail!("context limit: {} positions requested, the model allows {}", full.len + per, c.context_length);
        }
        if let Some(&r) = logit_rows.iter().find(|&&r| r >= n) {
            bail!("logit row {r} is outside the block of {n} tokens");
        }
        if let Some(&l) = capture_layers.iter().find(|&&l| l >= c.layers) {
            bail!("layer {l} does not exist (the model has {})", c.layers);
        }
        let work = &mut caches[0].work;
        let (mut x, mut hidden, mut layer_inputs) = (std::mem::take(&mut work.x), std::mem::take(&mut work.hidden), std::mem::take(&mut work.layer_inputs));
        self.embed_into(tokens, &mut x)?;
        layer_inputs.resize_with(capture_layers.len(), Vec::new);
        advance_sequences(&self.geometry, &self.layers, caches, rows, &mut x, None, |i, x| {
            for (slot, _) in capture_layers.iter().enumerate().filter(|(_, &l)| l == i) {
                layer_inputs[slot].clear();
                layer_inputs[slot].extend_from_slice(x);
            }
        });
        // Every value is written by the norm.
        hidden.resize(n * c.hidden, 0.0);
        rms_norm(&x, &self.norm, c.rms_eps, &mut hidden);
        let work = &mut caches[0].work;
        work.x = x;
        self.logits(&hidden, logit_rows, &mut work.matmul.0, &mut work.picked, &mut logits);
        Ok(Forward { hidden, logits, layer_inputs })
    }

    /// LM-head logits for the chosen rows of `hidden` (`[n, hidden]`), gathered into `picked`, into `out`, every
    /// value written (the product writes each output, so the buffer is not zeroed first).
    fn logits(&self, hidden: &[f32], rows: &[usize], scratch: &mut MatmulScratch, picked: &mut Vec<f32>, out: &mut Vec<f32>) {
        let (h, v) = (self.config.hidden, self.config.vocab);
        out.resize(rows.len() * v, 0.0);
        if rows.is_empty() {
            return;
        }
        picked.clear();
        picked.extend(rows.iter().flat_map(|&r| &hidden[r * h..(r + 1) * h]));
        self.lm_head().matmul(picked, out, scratch);
    }
}

/// A `[rows, cols]` projection `name.weight` (with `name.bias` when present), checked against the config.
pub fn load_linear(src: &dyn WeightSource, name: &str, rows: usize, cols: usize) -> Result<Linear> {
    let weight = src.matrix(&format!("{name}.weight"))?;
    if (weight.rows, weight.cols) != (rows, cols) {
        bail!(
            "{}: {name}.weight is [{}, {}], expected [{rows}, {cols}] from the model config",
            src.path().display(),
            weight.rows,
            weight.cols
        );
    }
    let bias_name = format!("{name}.bias");
    let bias = if src.contains(&bias_name) { Some(src.vector(&bias_name)?) } else { None };
    Ok(Linear { weight, bias })
}

pub fn load_norm(src: &dyn WeightSource, name: &str, hidden: usize) -> Result<Vec<f32>> {
    let v = src.vector(name)?;
    if v.len() != hidden {
        bail!("{}: {name} has {} values, expected {hidden}", src.path().display(), v.len());
    }
    Ok(v)
}

/// Decoder layer `prefix` (GGUF naming); `input_norm` false for EAGLE-1's first layer, which has none.
pub fn load_layer(src: &dyn WeightSource, c: &Config, prefix: &str, input_norm: bool) -> Result<Layer> {
    let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    Ok(Layer {
        attn_norm: if input_norm { Some(load_norm(src, &format!("{prefix}.attn_norm.weight"), c.hidden)?) } else { None },
        q: load_linear(src, &format!("{prefix}.attn_q"), qd, c.hidden)?,
        k: load_linear(src, &format!("{prefix}.attn_k"), kvd, c.hidden)?,
        v: load_linear(src, &format!("{prefix}.attn_v"), kvd, c.hidden)?,
        o: load_linear(src, &format!("{prefix}.attn_output"), c.hidden, qd)?,
        ffn_norm: load_norm(src, &format!("{prefix}.ffn_norm.weight"), c.hidden)?,
        gate: load_linear(src, &format!("{prefix}.ffn_gate"), c.intermediate, c.hidden)?,
        up: load_linear(src, &format!("{prefix}.ffn_up"), c.intermediate, c.hidden)?,
        down: load_linear(src, &format!("{prefix}.ffn_down"), c.hidden, c.intermediate)?,
    })
}

/// `gate ← silu(gate) · up` (silu(x) = x / (1 + e^−x)), on the pool when there is enough of it: the exponentials of
/// a batch of verification blocks (40 rows × 1,536 a layer for SmolLM2) ran on one core while the other waited for
/// the next product.
fn gate_in_place(gate: &mut [f32], up: &[f32]) {
    const CHUNK: usize = 2048;
    let apply = |(gate, up): (&mut [f32], &[f32])| {
        let mut exps = [0f32; 256];
        for (gate, up) in gate.chunks_mut(exps.len()).zip(up.chunks(exps.len())) {
            let exps = &mut exps[..gate.len()];
            exps.iter_mut().zip(gate.iter()).for_each(|(e, x)| *e = -x);
            exp_in_place(exps);
            gate.iter_mut().zip(up).zip(exps.iter()).for_each(|((a, u), e)| *a = *a / (1.0 + e) * u);
        }
    };
    match gate.len() < 2 * CHUNK {
        true => apply((gate, up)),
        false => pool().install(|| gate.par_chunks_mut(CHUNK).zip(up.par_chunks(CHUNK)).for_each(apply)),
    }
}

/// RMSNorm of each `[hidden]` row; the mean square is accumulated in f64 so row length does not cost accuracy.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (row, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / h as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        o.iter_mut().zip(row).zip(weight).for_each(|((o, v), w)| *o = w * (v * inv));
    }
}

/// RoPE inverse frequencies, with Llama-3.1's rescaling from the config or GGUF's `rope_freqs` factors.
fn inverse_frequencies(c: &Config, rope_freqs: Option<&[f32]>) -> Vec<f32> {
    let d = c.head_dim;
    let mut inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / d as f32)).collect();
    if let Some(factors) = rope_freqs {
        inv.iter_mut().zip(factors).for_each(|(f, s)| *f /= s);
    } else if let Some(s) = &c.rope_scaling {
        let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor;
        for f in inv.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            *f = if wavelen < high_wavelen {
                *f
            } else if wavelen > low_wavelen {
                *f / s.factor
            } else {
                let smooth = (s.original_max_position_embeddings as f32 / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * *f / s.factor + smooth * *f
            };
        }
    }
    inv
}

fn gguf_config(g: &Gguf) -> Result<Config> {
    let arch = g.meta_str("general.architecture")?.to_string();
    let rope_style = match arch.as_str() {
        "llama" => RopeStyle::Interleaved,
        "qwen2" => RopeStyle::Halves,
        other => bail!("{}: architecture '{other}' is not supported (frspec reads llama and qwen2)", g.path().display()),
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = g.meta_u32(&key("embedding_length"))? as usize;
    let heads = g.meta_u32(&key("attention.head_count"))? as usize;
    let kv_heads = g.meta_u32(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads);
    let head_dim = g.meta_u32(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden.checked_div(heads).unwrap_or(0));
    let vocab = match g.meta_u32(&key("vocab_size")) {
        Ok(v) => v as usize,
        Err(_) => g.content.tensor_infos.get("token_embd.weight").and_then(|t| t.shape.dims().first().copied()).ok_or_else(|| {
            anyhow!("{}: no {arch}.vocab_size and no token_embd.weight", g.path().display())
        })?,
    };
    let config = Config {
        hidden,
        intermediate: g.meta_u32(&key("feed_forward_length"))? as usize,
        layers: g.meta_u32(&key("block_count"))? as usize,
        heads,
        kv_heads,
        head_dim,
        vocab,
        rms_eps: g.meta_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: g.meta_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
        rope_style,
        rope_scaling: None,
        context_length: g.meta_u32(&key("context_length"))? as usize,
        architecture: arch,
        tied_embeddings: true,
    };
    validate(&config, g.path())?;
    Ok(config)
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f32,
    rope_theta: Option<f32>,
    max_position_embeddings: usize,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
}

pub fn hf_config(path: &Path) -> Result<Config> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read model config {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
    hf_config_from(json, path, false)
}

/// A model config from its JSON; `any_architecture` accepts EAGLE heads' own architecture names.
pub fn hf_config_from(json: serde_json::Value, path: &Path, any_architecture: bool) -> Result<Config> {
    let hf: HfConfig = serde_json::from_value(json).with_context(|| format!("{} is not a valid model config", path.display()))?;
    let arch = hf.architectures.as_ref().and_then(|a| a.first()).cloned().unwrap_or_default();
    if !any_architecture && !matches!(arch.as_str(), "LlamaForCausalLM" | "Qwen2ForCausalLM" | "MistralForCausalLM") {
        bail!("{}: architecture '{arch}' is not supported (frspec reads LlamaForCausalLM and Qwen2ForCausalLM)", path.display());
    }
    let rope_scaling = match &hf.rope_scaling {
        Some(v) if v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()) == Some("llama3") => Some(
            serde_json::from_value::<Llama3RopeScaling>(v.clone())
                .with_context(|| format!("{}: rope_scaling is not a valid llama3 scaling", path.display()))?,
        ),
        Some(serde_json::Value::Null) | None => None,
        Some(v) => bail!("{}: rope_scaling {v} is not supported (only llama3)", path.display()),
    };
    let config = Config {
        architecture: arch,
        hidden: hf.hidden_size,
        intermediate: hf.intermediate_size,
        layers: hf.num_hidden_layers,
        heads: hf.num_attention_heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim: hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
        vocab: hf.vocab_size,
        rms_eps: hf.rms_norm_eps,
        rope_theta: hf.rope_theta.unwrap_or(10_000.0),
        rope_style: RopeStyle::Halves,
        rope_scaling,
        context_length: hf.max_position_embeddings,
        tied_embeddings: hf.tie_word_embeddings.unwrap_or(false),
    };
    validate(&config, path)?;
    Ok(config)
}

fn validate(c: &Config, path: &Path) -> Result<()> {
    if c.heads == 0 || c.kv_heads == 0 || c.heads % c.kv_heads != 0 {
        bail!("{}: {} attention heads cannot share {} key/value heads", path.display(), c.heads, c.kv_heads);
    }
    if c.head_dim == 0 || c.head_dim % 2 != 0 || c.hidden == 0 || c.intermediate == 0 || c.layers == 0 || c.vocab == 0 {
        bail!("{}: implausible model dimensions {c:?}", path.display());
    }
    let positive = |x: f32| x.is_finite() && x > 0.0;
    if !positive(c.rms_eps) || !positive(c.rope_theta) {
        bail!("{}: the RMS-norm epsilon ({}) and RoPE base ({}) must be positive numbers", path.display(), c.rms_eps, c.rope_theta);
    }
    if let Some(s) = &c.rope_scaling {
        let factors = [s.factor, s.low_freq_factor, s.high_freq_factor];
        if !factors.into_iter().all(positive) || s.high_freq_factor == s.low_freq_factor || s.original_max_position_embeddings == 0 {
            bail!("{}: implausible rope_scaling {s:?}", path.display());
        }
    }
    Ok(())
}
