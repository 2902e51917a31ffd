//! The Llama forward as candle tensors on any device and dtype, and its decoder layer (shared with the EAGLE drafts
//! and training). Built from a CPU-engine model (weights dequantized) or with random weights of any shape (speed does
//! not depend on the values, so a Llama-3.1-8B run needs no download).

use super::kernels::{normed_product, normed_swiglu, product, product_plus, rotate_qk, rows_attention, rows_attention_fits, silu_mul, write_kv};
use crate::engine::cpu::model::{Config, Geometry, Model, RopeStyle};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

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

    /// SiLU(gate) × up of the projection of `rms_norm(x, g)`, its rows the gate's, then the up's.
    fn forward_normed_swiglu(&self, x: &Tensor, g: &Tensor, eps: f32) -> Result<Tensor> {
        match &self.b {
            Some(_) => silu_mul(&self.forward_normed(x, g, eps)?),
            None => normed_swiglu(x, g, eps, &self.w),
        }
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

    /// `x` `[rows, hidden]`, the rows of several sequences one after another, each at its place in `kv`, this layer's
    /// buffer of their pool (`Cache::extend`); `attn_input` replaces the (normed) stream as the attention's input
    /// (EAGLE-3). The projections run once over every row (one pass over the weights), one launch writes every
    /// row's keys and values, and one attends every row over its own sequence's cache. `rope` holds every row's
    /// position.
    pub fn forward_placed(&self, s: &Geometry, rope: &RopeTables, x: &Tensor, attn_input: Option<&Tensor>, kv: &Tensor, placed: &Placed) -> Result<Tensor> {
        let qkv = match (attn_input, &self.attn_norm) {
            (Some(a), _) => self.qkv.forward(a)?,
            (None, Some(g)) => self.qkv.forward_normed(x, g, s.rms_eps)?,
            (None, None) => self.qkv.forward(x)?,
        };
        let attended = placed.attend(&qkv, kv, rope, s.heads, s.head_dim)?;
        let x = self.o.forward_plus(&attended, x)?;
        self.down.forward_plus(&self.gate_up.forward_normed_swiglu(&x, &self.ffn_norm, s.rms_eps)?, &x)
    }
}

/// Where the rows of one forward go in a pool: each sequence's slot, its length before the forward and its rows, in
/// order; the same per row on the device for the kernels (`at`, `[rows, 2]` u32: slot, position); and how they
/// attend.
pub struct Placed {
    segments: Vec<Segment>,
    at: Tensor,
    longest: usize,
    fused: bool,
}

/// Consecutive rows of a forward that continue one sequence: its slot, its length before them, their count.
struct Segment {
    slot: usize,
    start: usize,
    rows: usize,
}

impl Placed {
    /// Each sequence's (length before the forward, rows): the runs of positions its rows take.
    pub fn runs(&self) -> Vec<(usize, usize)> {
        self.segments.iter().map(|s| (s.start, s.rows)).collect()
    }

    /// Every row's keys and values (rotated by `rope`) into `kv`, then the attention of every query row of `qkv` (not
    /// yet rotated) over its own sequence's cache: `[rows, heads · d]`. The fused kernels rotate as they read; candle's
    /// products need the rows rotated first.
    fn attend(&self, qkv: &Tensor, kv: &Tensor, rope: &RopeTables, heads: usize, d: usize) -> Result<Tensor> {
        if self.fused {
            write_kv(kv, qkv, &self.at, heads, Some(rope))?;
            return rows_attention(qkv, kv, &self.at, heads, self.longest, rope);
        }
        let kv_heads = kv.dim(2)?;
        rotate_qk(qkv, rope, heads + kv_heads, d)?;
        write_kv(kv, qkv, &self.at, heads, None)?;
        let mut attended = Vec::with_capacity(self.segments.len());
        let mut row = 0;
        for seg in &self.segments {
            let queries = qkv.narrow(0, row, seg.rows)?.narrow(1, 0, heads * d)?.reshape((seg.rows, heads, d))?.transpose(0, 1)?.contiguous()?;
            let cache = kv.get(seg.slot)?.narrow(2, 0, seg.start + seg.rows)?;
            attended.push(attention(&queries, &cache.get(0)?, &cache.get(1)?, seg.start)?);
            row += seg.rows;
        }
        Ok(Tensor::cat(&attended, 0)?)
    }
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

/// How a forward attends: frspec's fused kernel (every row of every sequence in one launch), or candle's products
/// and softmax a sequence at a time (kept so that `bench decode` can compare the two in one run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    #[default]
    Fused,
    Products,
}

/// The keys and values of every sequence one model (or draft) decodes: per layer one buffer
/// `[slots, 2, kv_heads, capacity, head_dim]` (keys, then values), each sequence's cache one slot of it. One buffer a
/// layer lets one launch write, and one attend over, the caches of a whole batch of sequences of different lengths.
/// Slots and capacity double when a cache needs more (one copy); positions past a cache's length are stale and
/// never read, so rolling back costs nothing, and a cache's slot goes back to the pool when the cache is dropped.
pub struct KvPool {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    /// Per layer; empty until the first forward.
    buffers: Vec<Tensor>,
    slots: usize,
    capacity: usize,
    /// Slots handed out so far, and those given back.
    handed_out: usize,
    free: Vec<usize>,
}

impl KvPool {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Arc<KvPool> {
        Arc::new(KvPool { layers, kv_heads, head_dim, dtype, device: device.clone(), state: Mutex::default() })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty cache in a slot of its own.
    pub fn cache(self: &Arc<Self>) -> Cache {
        let mut state = self.state();
        let slot = state.free.pop().unwrap_or_else(|| {
            state.handed_out += 1;
            state.handed_out - 1
        });
        Cache { pool: self.clone(), slot, len: 0, attention: Attention::default() }
    }

    /// Grow the buffers to hold `slots` slots of `positions` positions.
    fn reserve(&self, state: &mut PoolState, slots: usize, positions: usize) -> Result<()> {
        if slots <= state.slots && positions <= state.capacity {
            return Ok(());
        }
        let grown_slots = if slots > state.slots { slots.next_power_of_two() } else { state.slots };
        let grown_capacity = if positions > state.capacity { positions.next_power_of_two().max(64) } else { state.capacity };
        let zeros = |slots: usize, capacity: usize| Tensor::zeros((slots, 2, self.kv_heads, capacity, self.head_dim), self.dtype, &self.device);
        state.buffers = if state.buffers.is_empty() {
            (0..self.layers).map(|_| zeros(grown_slots, grown_capacity)).collect::<candle_core::Result<_>>()?
        } else {
            let grow = |old: &Tensor| -> candle_core::Result<Tensor> {
                let mut b = old.clone();
                if grown_capacity > state.capacity {
                    b = Tensor::cat(&[&b, &zeros(state.slots, grown_capacity - state.capacity)?], 3)?;
                }
                if grown_slots > state.slots {
                    b = Tensor::cat(&[&b, &zeros(grown_slots - state.slots, grown_capacity)?], 0)?;
                }
                Ok(b)
            };
            state.buffers.iter().map(grow).collect::<candle_core::Result<_>>()?
        };
        (state.slots, state.capacity) = (grown_slots, grown_capacity);
        Ok(())
    }
}

/// One sequence's keys and values: a slot of its model's pool, and how many positions it holds.
pub struct Cache {
    pool: Arc<KvPool>,
    slot: usize,
    len: usize,
    attention: Attention,
}

impl Cache {
    /// This cache, attending as `attention` says.
    pub fn attending(mut self, attention: Attention) -> Cache {
        self.attention = attention;
        self
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget positions `len..` (rejected drafts): the next forward writes over them.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Hold the first `len` positions of `from`, a cache of the same pool: its rows copied into this slot, one
    /// `write_kv` a layer (the rows read as keys and values after no query heads).
    pub fn copy_prefix(&mut self, from: &Cache, len: usize) -> Result<()> {
        if !Arc::ptr_eq(&self.pool, &from.pool) {
            bail!("a cache can only start from a cache of the same model");
        }
        if len > from.len {
            bail!("a prefix of {len} positions asked of a cache holding {}", from.len);
        }
        if len > 0 && self.slot != from.slot {
            let pool = &self.pool;
            let mut state = pool.state();
            pool.reserve(&mut state, self.slot.max(from.slot) + 1, len)?;
            let at: Vec<u32> = (0..len as u32).flat_map(|p| [self.slot as u32, p]).collect();
            let at = Tensor::from_vec(at, (len, 2), &pool.device)?;
            for kv in &state.buffers {
                // [2, kv_heads, len, d] as rows [len, 2 · kv_heads · d]: a row's keys, then its values.
                let rows = kv.get(from.slot)?.narrow(2, 0, len)?.permute((2, 0, 1, 3))?.contiguous()?.reshape((len, 2 * pool.kv_heads * pool.head_dim))?;
                write_kv(kv, &rows, &at, 0, None)?;
            }
        }
        self.len = len;
        Ok(())
    }

    /// Run `forward` with room for `rows[i]` more positions in `caches[i]` (all from one pool): it gets every layer's
    /// buffer and the rows' places, and each cache then counts its rows.
    pub fn extend<R>(caches: &mut [&mut Cache], rows: &[usize], forward: impl FnOnce(&[Tensor], &Placed) -> Result<R>) -> Result<R> {
        let pool = caches.first().context("a forward needs at least one sequence")?.pool.clone();
        if caches.iter().any(|c| !Arc::ptr_eq(&c.pool, &pool)) {
            bail!("the caches of one forward belong to one model");
        }
        let segments: Vec<Segment> = caches.iter().zip(rows).map(|(c, &rows)| Segment { slot: c.slot, start: c.len, rows }).collect();
        let longest = segments.iter().map(|s| s.start + s.rows).max().unwrap_or(0);
        let at: Vec<u32> = segments.iter().flat_map(|s| (s.start..s.start + s.rows).flat_map(move |p| [s.slot as u32, p as u32])).collect();
        let fused = caches.iter().all(|c| c.attention == Attention::Fused) && rows_attention_fits(longest, pool.head_dim, pool.dtype);
        let mut state = pool.state();
        pool.reserve(&mut state, segments.iter().map(|s| s.slot + 1).max().unwrap_or(0), longest)?;
        let placed = Placed { at: Tensor::from_vec(at, (rows.iter().sum::<usize>(), 2), &pool.device)?, segments, longest, fused };
        let out = forward(&state.buffers, &placed)?;
        drop(state);
        caches.iter_mut().zip(rows).for_each(|(c, &n)| c.len += n);
        Ok(out)
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.pool.state().free.push(self.slot);
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
    pool: Arc<KvPool>,
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
            pool: KvPool::new(model.config.layers, model.config.kv_heads, model.geometry.head_dim, dtype, device),
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
            pool: KvPool::new(shape.layers, shape.kv_heads, shape.head_dim, dtype, device),
            config: shape.clone(),
            dtype,
            device: device.clone(),
        })
    }

    /// An empty cache in this model's pool.
    pub fn new_cache(&self) -> Cache {
        self.pool.cache()
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
    /// continuing `caches[i]` (this model's), in order; each row attends over its own sequence's cache. Returns every
    /// row's hidden state and captured streams in the same order.
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
        let mut captured = vec![None; capture.len()];
        Cache::extend(caches, rows, |buffers, placed| {
            let rope = self.rope.runs(&placed.runs(), &self.device)?;
            for (i, (layer, kv)) in self.layers.iter().zip(buffers).enumerate() {
                for (slot, _) in capture.iter().enumerate().filter(|(_, &l)| l == i) {
                    captured[slot] = Some(x.clone());
                }
                x = layer.forward_placed(&self.geometry, &rope, &x, None, kv, placed)?;
            }
            Ok(())
        })?;
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
    Ok(super::kernels::argmax_rows(logits)?.to_vec1::<u32>()?)
}

/// Greedy continuation of `prompt` by `new_tokens` tokens, one forward per token.
pub fn greedy(model: &Llama, prompt: &[u32], new_tokens: usize) -> Result<Vec<u32>> {
    let mut cache = model.new_cache();
    crate::speculative::decode::greedy_steps(prompt, new_tokens, |tokens| model.greedy_next(tokens, &mut cache))
}
