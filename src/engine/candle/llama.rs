//! The Llama forward as candle tensors on any device and dtype, and its decoder layer (shared with the EAGLE drafts
//! and training). Built from a CPU-engine model (weights dequantized) or with random weights of any shape (speed does
//! not depend on the values, so a Llama-3.1-8B run needs no download).

use crate::engine::cpu::model::{Config, Geometry, Model, RopeStyle};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};

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
    let (h, q, kv) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let layer = 2 * h * q + 2 * h * kv + 3 * h * c.intermediate + 2 * h;
    c.layers * layer + c.vocab * h + 2 * h
}

/// A dense `[out, in]` matrix on the device, with the engine's values.
pub fn dense(m: &crate::engine::cpu::tensor::Matrix, device: &Device, dtype: DType) -> Result<Tensor> {
    let mut values = vec![0.0f32; m.rows * m.cols];
    for (r, row) in values.chunks_exact_mut(m.cols).enumerate() {
        m.row_into(r, row);
    }
    Ok(Tensor::from_vec(values, (m.rows, m.cols), &Device::Cpu)?.to_device(device)?.to_dtype(dtype)?)
}

/// RMSNorm in f32 whatever the activations' dtype; `w` is f32.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(xf.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?.to_dtype(x.dtype())?)
}

pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Rotary position embedding: which dimensions pair up, and their inverse frequencies.
#[derive(Clone, Debug)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub style: RopeStyle,
}

impl Rope {
    pub fn of(g: &Geometry) -> Rope {
        Rope { inv_freq: g.inv_freq.clone(), style: g.rope_style }
    }

    /// Plain RoPE of base `theta` over HF's rotate-half pairs.
    pub fn halves(theta: f64, head_dim: usize) -> Rope {
        let inv_freq = (0..head_dim / 2).map(|j| theta.powf(-(2.0 * j as f64) / head_dim as f64) as f32).collect();
        Rope { inv_freq, style: RopeStyle::Halves }
    }

    /// cos and sin of every rotated pair at positions `start..start + n`, for all layers of one forward.
    pub fn at(&self, start: usize, n: usize, device: &Device) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        // Angles formed in f32 and evaluated exactly, as the engine does.
        let angles: Vec<f64> = (0..n).flat_map(|i| self.inv_freq.iter().map(move |f| ((start + i) as f32 * f) as f64)).collect();
        let table = |f: fn(f64) -> f64| -> Result<Tensor> { Ok(Tensor::from_vec(angles.iter().map(|&a| f(a) as f32).collect::<Vec<_>>(), (n, half), device)?) };
        let (cos, sin) = (table(f64::cos)?, table(f64::sin)?);
        Ok(match self.style {
            // Rotate-half pairs dimension j with j + d/2: the tables cover both halves.
            RopeStyle::Halves => RopeTables { cos: Tensor::cat(&[&cos, &cos], 1)?, sin: Tensor::cat(&[&sin, &sin], 1)?, style: self.style },
            RopeStyle::Interleaved => RopeTables { cos, sin, style: self.style },
        })
    }
}

/// RoPE at a fixed run of positions: cos and sin `[n, head_dim / 2]` (interleaved) or `[n, head_dim]` (halves).
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl RopeTables {
    /// Rotate `x` `[heads, n, head_dim]`, computing in f32.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (heads, n, d) = x.dims3()?;
        let half = d / 2;
        let (cos, sin) = (&self.cos, &self.sin);
        let xf = x.to_dtype(DType::F32)?;
        let rotated = match self.style {
            RopeStyle::Halves => {
                let (a, b) = (xf.narrow(2, 0, half)?, xf.narrow(2, half, half)?);
                (xf.broadcast_mul(cos)? + Tensor::cat(&[&b.neg()?, &a], 2)?.broadcast_mul(sin)?)?
            }
            RopeStyle::Interleaved => {
                let pairs = xf.reshape((heads, n, half, 2))?;
                let (a, b) = (pairs.narrow(3, 0, 1)?.squeeze(3)?, pairs.narrow(3, 1, 1)?.squeeze(3)?);
                let ra = (a.broadcast_mul(cos)? - b.broadcast_mul(sin)?)?;
                let rb = (a.broadcast_mul(sin)? + b.broadcast_mul(cos)?)?;
                Tensor::stack(&[&ra, &rb], 3)?.reshape((heads, n, d))?
            }
        };
        Ok(rotated.to_dtype(x.dtype())?)
    }
}

/// Causal grouped-query attention of queries `q` `[heads, n, d]` at positions `start..start + n` over keys and
/// values `[kv_heads, start + n, d]`; returns `[n, heads · d]`. Scores and softmax in f32.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, start: usize) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (k, v) = (grouped(k, heads)?, grouped(v, heads)?);
    let total = k.dim(1)?;
    let mut scores = (q.to_dtype(DType::F32)?.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if n > 1 {
        scores = scores.broadcast_add(&causal_mask(n, total, start, false, q.device())?)?;
    }
    let out = softmax(&scores)?.matmul(&v)?;
    Ok(out.transpose(0, 1)?.reshape((n, heads * d))?.to_dtype(q.dtype())?)
}

/// Attention as a draft step sees it after its first draft: query row i attends to the context rows `k`, `v` before
/// it (0..i, computed from true target features) and to its own row `k_own`, `v_own` (computed from a predicted
/// feature), all `[kv_heads, n, d]` for queries `[heads, n, d]` at positions 0..n; returns `[n, heads · d]`. Scores
/// and softmax in f32, as in `attention`.
pub fn attention_after_context(q: &Tensor, k: &Tensor, v: &Tensor, k_own: &Tensor, v_own: &Tensor) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (k, v, k_own, v_own) = (grouped(k, heads)?, grouped(v, heads)?, grouped(k_own, heads)?, grouped(v_own, heads)?);
    let qf = q.to_dtype(DType::F32)?;
    let scale = (d as f64).sqrt();
    let context = (qf.matmul(&k.t()?)? / scale)?.broadcast_add(&causal_mask(n, n, 0, true, q.device())?)?;
    let own = ((&qf * &k_own)?.sum_keepdim(2)? / scale)?;
    let p = softmax(&Tensor::cat(&[&context, &own], 2)?)?;
    let out = (p.narrow(2, 0, n)?.matmul(&v)? + p.narrow(2, n, 1)?.broadcast_mul(&v_own)?)?;
    Ok(out.transpose(0, 1)?.reshape((n, heads * d))?.to_dtype(q.dtype())?)
}

/// Keys or values `[kv_heads, n, d]` repeated for `heads` query heads (grouped-query attention), in f32.
fn grouped(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (kv_heads, n, d) = t.dims3()?;
    Ok(t.to_dtype(DType::F32)?.unsqueeze(1)?.broadcast_as((kv_heads, heads / kv_heads, n, d))?.reshape((heads, n, d))?)
}

/// −∞ where key j lies after query i at position start + i (`strict`: or at it), else 0: `[n, total]`.
fn causal_mask(n: usize, total: usize, start: usize, strict: bool, device: &Device) -> Result<Tensor> {
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
        let b = p.bias.as_ref().map(|b| Tensor::from_slice(b, b.len(), device)?.to_dtype(dtype)).transpose()?;
        Ok(Proj { w: dense(&p.weight, device, dtype)?, b })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.w.t()?)?;
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
        Ok(Tensor::ones(n, DType::F32, self.device)?)
    }
}

/// One decoder layer; EAGLE layers have no input norm.
pub struct Layer {
    attn_norm: Option<Tensor>,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    ffn_norm: Tensor,
    gate: Proj,
    up: Proj,
    down: Proj,
}

impl Layer {
    pub fn from_engine(l: &crate::engine::cpu::model::Layer, device: &Device, dtype: DType) -> Result<Layer> {
        let proj = |p| Proj::from_engine(p, device, dtype);
        let norm = |w: &[f32]| Tensor::from_slice(w, w.len(), device);
        Ok(Layer {
            attn_norm: l.attn_norm.as_deref().map(norm).transpose()?,
            q: proj(&l.q)?,
            k: proj(&l.k)?,
            v: proj(&l.v)?,
            o: proj(&l.o)?,
            ffn_norm: norm(&l.ffn_norm)?,
            gate: proj(&l.gate)?,
            up: proj(&l.up)?,
            down: proj(&l.down)?,
        })
    }

    pub(crate) fn random(s: &Config, r: &Random, attn_norm: bool) -> Result<Layer> {
        let (h, kv, i) = (s.hidden, s.kv_heads * s.head_dim, s.intermediate);
        Ok(Layer {
            attn_norm: if attn_norm { Some(r.ones(h)?) } else { None },
            q: r.proj(s.heads * s.head_dim, h)?,
            k: r.proj(kv, h)?,
            v: r.proj(kv, h)?,
            o: r.proj(h, s.heads * s.head_dim)?,
            ffn_norm: r.ones(h)?,
            gate: r.proj(i, h)?,
            up: r.proj(i, h)?,
            down: r.proj(h, i)?,
        })
    }

    /// `x` `[n, hidden]` at positions `start..`, appending its keys and values to `cache`. `attn_input` replaces
    /// the (normed) stream as the attention's input (EAGLE-3).
    pub fn forward(&self, s: &Geometry, rope: &RopeTables, x: &Tensor, attn_input: Option<&Tensor>, cache: &mut LayerCache, start: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        let normed = match (attn_input, &self.attn_norm) {
            (Some(a), _) => a.clone(),
            (None, Some(w)) => rms_norm(x, w, s.rms_eps as f64)?,
            (None, None) => x.clone(),
        };
        let heads = |t: Tensor, count: usize| -> Result<Tensor> { Ok(t.reshape((n, count, s.head_dim))?.transpose(0, 1)?.contiguous()?) };
        let q = rope.apply(&heads(self.q.forward(&normed)?, s.heads)?)?;
        let k = rope.apply(&heads(self.k.forward(&normed)?, s.kv_heads)?)?;
        let v = heads(self.v.forward(&normed)?, s.kv_heads)?;
        let (k, v) = cache.append(k, v)?;
        let x = (x + self.o.forward(&attention(&q, &k, &v, start)?)?)?;
        let m = rms_norm(&x, &self.ffn_norm, s.rms_eps as f64)?;
        let act = (self.gate.forward(&m)?.silu()? * self.up.forward(&m)?)?;
        Ok((x + self.down.forward(&act)?)?)
    }
}

/// One layer's keys and values `[kv_heads, len, head_dim]`.
#[derive(Default)]
pub struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let kv = match self.kv.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        self.kv = Some(kv.clone());
        Ok(kv)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if let Some((k, v)) = self.kv.take() {
            self.kv = if len == 0 { None } else { Some((k.narrow(1, 0, len)?, v.narrow(1, 0, len)?)) };
        }
        Ok(())
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
        Cache { layers: (0..layers).map(|_| LayerCache::default()).collect(), len: 0 }
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

    /// Forget positions `len..` (rejected drafts); nothing when the cache holds no more than `len`.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len < self.len {
            for l in &mut self.layers {
                l.truncate(len)?;
            }
            self.len = len;
        }
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
            norm: Tensor::from_slice(model.norm(), model.norm().len(), device)?,
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
        let c = &self.config;
        if cache.len + tokens.len() > c.context_length {
            bail!("context limit: {} positions requested, the model allows {}", cache.len + tokens.len(), c.context_length);
        }
        if let Some(&l) = capture.iter().find(|&&l| l >= c.layers) {
            bail!("layer {l} does not exist (the model has {})", c.layers);
        }
        let start = cache.len;
        let mut x = self.embed(tokens)?;
        let rope = self.rope.at(start, tokens.len(), &self.device)?;
        let mut captured = vec![None; capture.len()];
        for (i, (layer, kv)) in self.layers.iter().zip(&mut cache.layers).enumerate() {
            for (slot, _) in capture.iter().enumerate().filter(|(_, &l)| l == i) {
                captured[slot] = Some(x.clone());
            }
            x = layer.forward(&self.geometry, &rope, &x, None, kv, start)?;
        }
        cache.len = start + tokens.len();
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
        Ok(hidden.matmul(&self.lm_head.t()?)?)
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
