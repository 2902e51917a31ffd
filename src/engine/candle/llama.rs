//! The Llama forward as candle tensors on any device and dtype, and its decoder layer (shared with the EAGLE drafts
//! and training). Built from a CPU-engine model (weights dequantized) or with random weights of any shape (speed does
//! not depend on the values, so a Llama-3.1-8B run needs no download).

use super::kernels::{decode_attention, decode_attention_fits, normed_product, product, product_plus, rotate_qk, silu_mul};
use crate::engine::cpu::model::{Config, Geometry, Model, RopeStyle};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use std::sync::Mutex;

/// The dimensions users ask about by name (from the models' config.json files), as a model config.
pub fn named_shape(name: &str) -> Result<Config> {
    let (hidden, intermediate, layers, heads, kv_heads, vocab, rope_theta) = match name {
        "llama31-8b" => (4096, 14336, 32, 32, 8, 128_256, 500_000.0),
        "smollm2-135m" => (576, 1536, 30, 9, 3, 49_152, 100_000.0),
        other => bail!("--shape {other}: expected llama31-8b or smollm2-135m"),
    };
    Ok(Config {
        architecture: "llama".into(),
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim: hidden / heads,
        vocab,
        rms_eps: 1e-5,
        rope_theta,
        rope_style: RopeStyle::Halves,
        rope_scaling: None,
        context_length: 131_072,
        tied_embeddings: false,
    })
}

/// Parameters one decode step reads: every layer, the final norm and the LM head (of the embedding, one row).
pub fn streamed_parameters(c: &Config) -> usize {
    c.layers * layer_parameters(c) + c.vocab * c.hidden + 2 * c.hidden
}

/// Parameters of one decoder layer: projections and both norms.
pub fn layer_parameters(c: &Config) -> usize {
    let (h, q, kv) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
    2 * h * q + 2 * h * kv + 3 * h * c.intermediate + 2 * h
}

/// A dense `[out, in]` matrix on the device, with the engine's values.
pub fn dense(m: &crate::engine::cpu::tensor::Matrix, device: &Device, dtype: DType) -> Result<Tensor> {
    let mut values = vec![0.0f32; m.rows * m.cols];
    for (r, row) in values.chunks_exact_mut(m.cols).enumerate() {
        m.row_into(r, row);
    }
    Ok(Tensor::from_vec(values, (m.rows, m.cols), &Device::Cpu)?.to_device(device)?.to_dtype(dtype)?)
}

/// RMSNorm over the last dimension (candle-nn's fused kernel: statistics in f32 whatever the dtype); `w` is in
/// `x`'s dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(x, w, eps as f32)?)
}

/// Rotary position embedding: which dimensions pair up, their inverse frequencies, and the cos and sin of every
/// position used so far, kept on the device (built once, doubled when a longer context needs more).
#[derive(Debug)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub style: RopeStyle,
    table: Mutex<Option<(Tensor, Tensor)>>,
}

impl Rope {
    pub fn of(g: &Geometry) -> Rope {
        Rope { inv_freq: g.inv_freq.clone(), style: g.rope_style, table: Mutex::new(None) }
    }

    /// Plain RoPE of base `theta` over HF's rotate-half pairs.
    pub fn halves(theta: f64, head_dim: usize) -> Rope {
        let inv_freq = (0..head_dim / 2).map(|j| theta.powf(-(2.0 * j as f64) / head_dim as f64) as f32).collect();
        Rope { inv_freq, style: RopeStyle::Halves, table: Mutex::new(None) }
    }

    /// cos and sin `[n, head_dim / 2]` (f32) of positions `start..start + n`, for all layers of one forward.
    pub fn at(&self, start: usize, n: usize, device: &Device) -> Result<RopeTables> {
        self.runs(&[(start, n)], device)
    }

    /// cos and sin of the positions of several runs `(start, n)` one after another (a batch's sequences): views of
    /// the table for one run, rows gathered once for several.
    pub fn runs(&self, runs: &[(usize, usize)], device: &Device) -> Result<RopeTables> {
        let end = runs.iter().map(|&(start, n)| start + n).max().unwrap_or(0);
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |t: &(Tensor, Tensor)| t.0.dim(0).is_ok_and(|len| len >= end) && t.0.device().same_device(device);
        if !table.as_ref().is_some_and(fits) {
            *table = Some(self.table(end.next_power_of_two().max(256), device)?);
        }
        let (cos, sin) = table.as_ref().expect("just built");
        if let [(start, n)] = runs {
            return Ok(RopeTables { cos: cos.narrow(0, *start, *n)?, sin: sin.narrow(0, *start, *n)?, style: self.style });
        }
        let positions: Vec<u32> = runs.iter().flat_map(|&(start, n)| start as u32..(start + n) as u32).collect();
        let positions = Tensor::from_vec(positions, runs.iter().map(|r| r.1).sum::<usize>(), device)?;
        Ok(RopeTables { cos: cos.index_select(&positions, 0)?, sin: sin.index_select(&positions, 0)?, style: self.style })
    }

    fn table(&self, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        // Angles formed in f32 and evaluated exactly, as the engine does.
        let angles: Vec<f64> = (0..positions).flat_map(|i| self.inv_freq.iter().map(move |f| (i as f32 * f) as f64)).collect();
        let table = |f: fn(f64) -> f64| -> Result<Tensor> { Ok(Tensor::from_vec(angles.iter().map(|&a| f(a) as f32).collect::<Vec<_>>(), (positions, half), device)?) };
        Ok((table(f64::cos)?, table(f64::sin)?))
    }
}

/// RoPE at a fixed run of positions: cos and sin `[n, head_dim / 2]`, f32.
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
    pub style: RopeStyle,
}

/// Causal grouped-query attention of queries `q` `[heads, n, d]` at positions `start..start + n` over keys and
/// values `[kv_heads, start + n, d]` (views of the cache); returns `[n, heads · d]`. Each key/value head serves its
/// group of query heads as one product (no repeated copy of the cache); softmax accumulates in f32.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, start: usize) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (kv_heads, total, _) = k.dims3()?;
    let group = heads / kv_heads;
    // Query heads h = kv · group + j: rows of one key/value head's group are contiguous.
    let q = q.reshape((kv_heads, group * n, d))?;
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if n > 1 {
        let mask = causal_mask(n, total, start, false, q.device())?.to_dtype(q.dtype())?;
        scores = scores.reshape((kv_heads, group, n, total))?.broadcast_add(&mask)?.reshape((kv_heads, group * n, total))?;
    }
    let out = candle_nn::ops::softmax_last_dim(&scores)?.matmul(v)?;
    Ok(out.reshape((heads, n, d))?.transpose(0, 1)?.reshape((n, heads * d))?)
}

/// −∞ where key j lies after query i at position start + i (`strict`: or at it), else 0: `[n, total]`.
pub(crate) fn causal_mask(n: usize, total: usize, start: usize, strict: bool, device: &Device) -> Result<Tensor> {
    let hidden = move |i: usize, j: usize| j > start + i || (strict && j == start + i);
    let mask: Vec<f32> = (0..n).flat_map(|i| (0..total).map(move |j| if hidden(i, j) { f32::NEG_INFINITY } else { 0.0 })).collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}

/// `x · wᵀ (+ b)` with `w` `[out, in]`.
pub struct Proj {
    w: Tensor,
    b: Option<Tensor>,
}

impl Proj {
    /// The engine's projection, weights dequantized onto `device` in `dtype`.
    pub fn from_engine(p: &crate::engine::cpu::model::Linear, device: &Device, dtype: DType) -> Result<Proj> {
        Proj::stacked(&[p], device, dtype)
    }

    /// The engine's projections stacked as one (their outputs side by side): one product where there were several.
    fn stacked(parts: &[&crate::engine::cpu::model::Linear], device: &Device, dtype: DType) -> Result<Proj> {
        let w = parts.iter().map(|p| dense(&p.weight, device, dtype)).collect::<Result<Vec<_>>>()?;
        let b = if parts.iter().any(|p| p.bias.is_some()) {
            let bias: Vec<f32> = parts.iter().flat_map(|p| p.bias.clone().unwrap_or_else(|| vec![0.0; p.weight.rows])).collect();
            let len = bias.len();
            Some(Tensor::from_vec(bias, len, device)?.to_dtype(dtype)?)
        } else {
            None
        };
        Ok(Proj { w: Tensor::cat(&w, 0)?, b })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.biased(product(x, &self.w)?)
    }

    /// The projection of `rms_norm(x, g)`.
    fn forward_normed(&self, x: &Tensor, g: &Tensor, eps: f32) -> Result<Tensor> {
        self.biased(normed_product(x, g, eps, &self.w)?)
    }

    /// The projection of `x` plus the residual `r`.
    fn forward_plus(&self, x: &Tensor, r: &Tensor) -> Result<Tensor> {
        self.biased(product_plus(x, &self.w, r)?)
    }

    fn biased(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Weights drawn at random, scaled so activations stay of order one through many layers.
pub(crate) struct Random<'a> {
    pub device: &'a Device,
    pub dtype: DType,
}

impl Random<'_> {
    fn matrix(&self, rows: usize, cols: usize) -> Result<Tensor> {
        Ok(Tensor::randn(0f32, (1.0 / cols as f64).sqrt() as f32, (rows, cols), self.device)?.to_dtype(self.dtype)?)
    }

    pub(crate) fn proj(&self, rows: usize, cols: usize) -> Result<Proj> {
        Ok(Proj { w: self.matrix(rows, cols)?, b: None })
    }

    fn ones(&self, n: usize) -> Result<Tensor> {
        Ok(Tensor::ones(n, self.dtype, self.device)?)
    }
}

/// A norm's weights on the device, in the activations' dtype (what the fused kernel takes).
pub(crate) fn norm_weights(w: &[f32], device: &Device, dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_slice(w, w.len(), device)?.to_dtype(dtype)?)
}

/// One decoder layer; EAGLE layers have no input norm. Queries, keys and values are one product, as are gate and up.
pub struct Layer {
    attn_norm: Option<Tensor>,
    qkv: Proj,
    o: Proj,
    ffn_norm: Tensor,
    gate_up: Proj,
    down: Proj,
}

impl Layer {
    pub fn from_engine(l: &crate::engine::cpu::model::Layer, device: &Device, dtype: DType) -> Result<Layer> {
        let norm = |w: &[f32]| norm_weights(w, device, dtype);
        Ok(Layer {
            attn_norm: l.attn_norm.as_deref().map(norm).transpose()?,
            qkv: Proj::stacked(&[&l.q, &l.k, &l.v], device, dtype)?,
            o: Proj::from_engine(&l.o, device, dtype)?,
            ffn_norm: norm(&l.ffn_norm)?,
            gate_up: Proj::stacked(&[&l.gate, &l.up], device, dtype)?,
            down: Proj::from_engine(&l.down, device, dtype)?,
        })
    }

    pub(crate) fn random(s: &Config, r: &Random, attn_norm: bool) -> Result<Layer> {
        let (h, q, kv, i) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate);
        Ok(Layer {
            attn_norm: if attn_norm { Some(r.ones(h)?) } else { None },
            qkv: r.proj(q + 2 * kv, h)?,
            o: r.proj(h, q)?,
            ffn_norm: r.ones(h)?,
            gate_up: r.proj(2 * i, h)?,
            down: r.proj(h, i)?,
        })
    }

    /// `x` `[n, hidden]` at positions `start..`, writing its keys and values into `cache` there. `attn_input`
    /// replaces the (normed) stream as the attention's input (EAGLE-3).
    pub fn forward(&self, s: &Geometry, rope: &RopeTables, x: &Tensor, attn_input: Option<&Tensor>, cache: &mut LayerCache, start: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        self.forward_segments(s, rope, x, attn_input, &mut [Segment { cache, start, rows: n }])
    }

    /// `forward` for the rows of several sequences one after another: the projections run once over every row
    /// (one pass over the weights), attention per sequence over its own cache. `rope` holds every row's position.
    pub fn forward_segments(&self, s: &Geometry, rope: &RopeTables, x: &Tensor, attn_input: Option<&Tensor>, segments: &mut [Segment]) -> Result<Tensor> {
        let qkv = match (attn_input, &self.attn_norm) {
            (Some(a), _) => self.qkv.forward(a)?,
            (None, Some(g)) => self.qkv.forward_normed(x, g, s.rms_eps)?,
            (None, None) => self.qkv.forward(x)?,
        };
        let (d, heads, kv_heads) = (s.head_dim, s.heads, s.kv_heads);
        rotate_qk(&qkv, &rope.cos, &rope.sin, heads + kv_heads, d, rope.style)?;
        let mut attended = Vec::with_capacity(segments.len());
        let mut row = 0;
        for seg in segments.iter_mut() {
            let (n, qkv) = (seg.rows, qkv.narrow(0, row, seg.rows)?);
            // A row's keys and values lie side by side: the cache's `[2, kv_heads, n, d]` block (a view when n = 1).
            seg.cache.write(&qkv.narrow(1, heads * d, 2 * kv_heads * d)?.reshape((n, 2, kv_heads, d))?.permute((1, 2, 0, 3))?, seg.start)?;
            attended.push(seg.cache.attend(&qkv.narrow(1, 0, heads * d)?, heads, seg.start)?);
            row += n;
        }
        let attended = if attended.len() == 1 { attended.pop().expect("one segment") } else { Tensor::cat(&attended, 0)? };
        let x = self.o.forward_plus(&attended, x)?;
        let gate_up = self.gate_up.forward_normed(&x, &self.ffn_norm, s.rms_eps)?;
        self.down.forward_plus(&silu_mul(&gate_up)?, &x)
    }
}

/// Consecutive rows of a batch that continue one sequence: the layer cache they extend and its length before.
pub struct Segment<'c> {
    pub cache: &'c mut LayerCache,
    pub start: usize,
    pub rows: usize,
}

/// Rows along one dimension of a buffer allocated ahead and written in place. When a write would run past the end,
/// the buffer doubles (one copy); positions past a write are stale and never read, so rolling back costs nothing.
pub(crate) struct Rows {
    buf: Option<Tensor>,
    dim: usize,
}

impl Rows {
    pub(crate) fn along(dim: usize) -> Rows {
        Rows { buf: None, dim }
    }

    /// Put `rows` at `at..at + n` along the dimension, keeping `0..at`.
    pub(crate) fn write(&mut self, at: usize, rows: &Tensor) -> Result<()> {
        let n = rows.dim(self.dim)?;
        let capacity = self.buf.as_ref().map_or(Ok(0), |b| b.dim(self.dim))?;
        if at + n > capacity {
            let mut dims = rows.dims().to_vec();
            dims[self.dim] = (at + n).next_power_of_two().max(64);
            let grown = Tensor::zeros(dims, rows.dtype(), rows.device())?;
            if let (Some(old), true) = (&self.buf, at > 0) {
                grown.slice_set(&old.narrow(self.dim, 0, at)?.contiguous()?, self.dim, 0)?;
            }
            self.buf = Some(grown);
        }
        let buf = self.buf.as_ref().expect("allocated above");
        Ok(buf.slice_set(&rows.contiguous()?, self.dim, at)?)
    }

    /// Rows `start..start + n`, a view.
    pub(crate) fn view(&self, start: usize, n: usize) -> Result<Tensor> {
        Ok(self.buffer()?.narrow(self.dim, start, n)?)
    }

    /// The whole buffer, filled or not.
    pub(crate) fn buffer(&self) -> Result<&Tensor> {
        self.buf.as_ref().context("no rows written yet")
    }
}

/// How a one-token step attends to the cache: frspec's fused kernel, or candle's products and softmax as blocks of
/// tokens do (kept so that `bench decode` can compare the two in one run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OneTokenAttention {
    #[default]
    Fused,
    Products,
}

/// One layer's keys and values, `[2, kv_heads, capacity, head_dim]` (keys, then values).
pub struct LayerCache {
    kv: Rows,
    one_token: OneTokenAttention,
}

impl LayerCache {
    fn new(one_token: OneTokenAttention) -> LayerCache {
        LayerCache { kv: Rows::along(2), one_token }
    }

    /// Write keys and values `[2, kv_heads, n, d]` at positions `start..`.
    fn write(&mut self, kv: &Tensor, start: usize) -> Result<()> {
        self.kv.write(start, kv)
    }

    /// The attention of query rows `[n, heads · d]` at positions `start..start + n` over the cache up to them:
    /// `[n, heads · d]`.
    fn attend(&self, queries: &Tensor, heads: usize, start: usize) -> Result<Tensor> {
        let (n, width) = queries.dims2()?;
        let (d, len) = (width / heads, start + n);
        if n == 1 && self.one_token == OneTokenAttention::Fused && decode_attention_fits(len, d) {
            return decode_attention(queries, self.kv.buffer()?, len);
        }
        let kv = self.kv.view(0, len)?;
        attention(&queries.reshape((n, heads, d))?.transpose(0, 1)?.contiguous()?, &kv.get(0)?, &kv.get(1)?, start)
    }
}

/// The keys and values of every layer, and how many positions they hold.
#[derive(Default)]
pub struct Cache {
    layers: Vec<LayerCache>,
    len: usize,
}

impl Cache {
    pub fn new(layers: usize) -> Cache {
        Cache::attending(layers, OneTokenAttention::default())
    }

    /// A cache whose one-token steps attend as `one_token` says.
    pub fn attending(layers: usize, one_token: OneTokenAttention) -> Cache {
        Cache { layers: (0..layers).map(|_| LayerCache::new(one_token)).collect(), len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layer `i`'s keys and values, for a caller running layers itself (a draft); `advance` then counts them.
    pub fn layer(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }

    /// Count `n` positions appended by a caller running the layers itself.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forget positions `len..` (rejected drafts): the next forward writes over them.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.len = self.len.min(len);
        Ok(())
    }
}

/// A Llama target on a device.
pub struct Llama {
    pub config: Config,
    pub geometry: Geometry,
    rope: Rope,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    pub dtype: DType,
    pub device: Device,
}

impl Llama {
    /// The engine's model, weights dequantized onto `device` in `dtype`.
    pub fn from_engine(model: &Model, device: &Device, dtype: DType) -> Result<Llama> {
        let embed = dense(model.embedding(), device, dtype)?;
        let lm_head = if std::ptr::eq(model.lm_head(), model.embedding()) { embed.clone() } else { dense(model.lm_head(), device, dtype)? };
        Ok(Llama {
            config: model.config.clone(),
            geometry: model.geometry.clone(),
            rope: Rope::of(&model.geometry),
            embed,
            layers: model.layers().iter().map(|l| Layer::from_engine(l, device, dtype)).collect::<Result<_>>()?,
            norm: norm_weights(model.norm(), device, dtype)?,
            lm_head,
            dtype,
            device: device.clone(),
        })
    }

    /// Random weights of the dimensions `shape` gives (an untied LM head, as Llama-3.1-8B has).
    pub fn random(shape: &Config, device: &Device, dtype: DType) -> Result<Llama> {
        let r = Random { device, dtype };
        let geometry = Geometry::new(shape, None);
        Ok(Llama {
            rope: Rope::of(&geometry),
            geometry,
            embed: r.matrix(shape.vocab, shape.hidden)?,
            layers: (0..shape.layers).map(|_| Layer::random(shape, &r, true)).collect::<Result<_>>()?,
            norm: r.ones(shape.hidden)?,
            lm_head: r.matrix(shape.vocab, shape.hidden)?,
            config: shape.clone(),
            dtype,
            device: device.clone(),
        })
    }

    pub fn new_cache(&self) -> Cache {
        Cache::new(self.layers.len())
    }

    /// Embedding rows of `tokens`, `[n, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.config.vocab) {
            bail!("token id {t} is outside the model's vocabulary of {}", self.config.vocab);
        }
        Ok(self.embed.index_select(&Tensor::from_slice(tokens, tokens.len(), &self.device)?, 0)?)
    }

    /// Forward `tokens` at positions `cache.len()..`; returns the hidden states after the final norm `[n, hidden]`.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Result<Tensor> {
        Ok(self.forward_capturing(tokens, cache, &[])?.0)
    }

    /// `forward`, also returning the stream entering each of `capture` (layer indices), `[n, hidden]` each.
    pub fn forward_capturing(&self, tokens: &[u32], cache: &mut Cache, capture: &[usize]) -> Result<(Tensor, Vec<Tensor>)> {
        self.forward_sequences(tokens, &mut [cache], &[tokens.len()], capture)
    }

    /// `forward_capturing` for several sequences in one pass over the weights: `tokens` holds `rows[i]` tokens
    /// continuing `caches[i]`, in order; attention runs per sequence over its own cache. Returns every row's hidden
    /// state and captured streams in the same order.
    pub fn forward_sequences(&self, tokens: &[u32], caches: &mut [&mut Cache], rows: &[usize], capture: &[usize]) -> Result<(Tensor, Vec<Tensor>)> {
        let c = &self.config;
        if tokens.is_empty() || rows.len() != caches.len() || rows.iter().sum::<usize>() != tokens.len() {
            bail!("{} tokens do not split into blocks of {rows:?} rows for {} sequences", tokens.len(), caches.len());
        }
        if let Some((full, n)) = caches.iter().zip(rows).find(|(k, &n)| k.len + n > c.context_length) {
            bail!("context limit: {} positions requested, the model allows {}", full.len + n, c.context_length);
        }
        if let Some(&l) = capture.iter().find(|&&l| l >= c.layers) {
            bail!("layer {l} does not exist (the model has {})", c.layers);
        }
        let mut x = self.embed(tokens)?;
        let runs: Vec<(usize, usize)> = caches.iter().zip(rows).map(|(k, &n)| (k.len, n)).collect();
        let rope = self.rope.runs(&runs, &self.device)?;
        let mut captured = vec![None; capture.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            for (slot, _) in capture.iter().enumerate().filter(|(_, &l)| l == i) {
                captured[slot] = Some(x.clone());
            }
            let mut segments: Vec<Segment> = caches.iter_mut().zip(&runs).map(|(k, &(start, rows))| Segment { cache: &mut k.layers[i], start, rows }).collect();
            x = layer.forward_segments(&self.geometry, &rope, &x, None, &mut segments)?;
        }
        caches.iter_mut().zip(rows).for_each(|(k, &n)| k.len += n);
        Ok((rms_norm(&x, &self.norm, c.rms_eps as f64)?, captured.into_iter().map(|t| t.expect("every captured layer exists")).collect()))
    }

    /// Forward `tokens` at positions `cache.len()..`; the greedy token after the last of them.
    pub fn greedy_next(&self, tokens: &[u32], cache: &mut Cache) -> Result<u32> {
        let hidden = self.forward(tokens, cache)?;
        Ok(argmax_rows(&self.logits(&hidden.narrow(0, tokens.len() - 1, 1)?)?)?[0])
    }

    /// The LM head `[vocab, hidden]`.
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Full-vocabulary logits `[n, vocab]` of hidden states `[n, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        product(hidden, &self.lm_head)
    }
}

/// Argmax of every row of `logits` `[n, V]`, copied to the host (which also waits for the device).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

/// Greedy continuation of `prompt` by `new_tokens` tokens, one forward per token.
pub fn greedy(model: &Llama, prompt: &[u32], new_tokens: usize) -> Result<Vec<u32>> {
    let mut cache = model.new_cache();
    crate::speculative::decode::greedy_steps(prompt, new_tokens, |tokens| model.greedy_next(tokens, &mut cache))
}
