//! The ops training differentiates through, composed of candle's primitive ops: candle-nn's fused kernels, which
//! the inference forward uses, have no backward pass. Training runs in f32 on the CPU.

use crate::engine::candle::llama::{causal_mask, RopeTables};
use anyhow::Result;
use candle_core::{Tensor, D};

pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm_slow(x, w, eps as f32)?)
}

pub fn softmax(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::softmax(x, D::Minus1)?)
}

/// Rotate `x` `[heads, n, d]` (rotate-half pairs).
pub fn rope(tables: &RopeTables, x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::rotary_emb::rope_slow(&x.unsqueeze(0)?, &tables.cos, &tables.sin)?.squeeze(0)?)
}

/// Causal grouped-query attention of queries `q` `[heads, n, d]` at positions `start..start + n` over keys and
/// values `[kv_heads, start + n, d]`; returns `[n, heads · d]`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, start: usize) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (k, v) = (grouped(k, heads)?, grouped(v, heads)?);
    let total = k.dim(1)?;
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if n > 1 {
        scores = scores.broadcast_add(&causal_mask(n, total, start, false, q.device())?)?;
    }
    let out = softmax(&scores)?.matmul(&v)?;
    Ok(out.transpose(0, 1)?.reshape((n, heads * d))?)
}

/// Attention as a draft step sees it after its first draft: query row i attends to the context rows `k`, `v` before
/// it (0..i, computed from true target features) and to its own row `k_own`, `v_own` (computed from a predicted
/// feature), all `[kv_heads, n, d]` for queries `[heads, n, d]` at positions 0..n; returns `[n, heads · d]`.
pub fn attention_after_context(q: &Tensor, k: &Tensor, v: &Tensor, k_own: &Tensor, v_own: &Tensor) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (k, v, k_own, v_own) = (grouped(k, heads)?, grouped(v, heads)?, grouped(k_own, heads)?, grouped(v_own, heads)?);
    let scale = (d as f64).sqrt();
    let context = (q.matmul(&k.t()?)? / scale)?.broadcast_add(&causal_mask(n, n, 0, true, q.device())?)?;
    let own = ((q * &k_own)?.sum_keepdim(2)? / scale)?;
    let p = softmax(&Tensor::cat(&[&context, &own], 2)?)?;
    let out = (p.narrow(2, 0, n)?.matmul(&v)? + p.narrow(2, n, 1)?.broadcast_mul(&v_own)?)?;
    Ok(out.transpose(0, 1)?.reshape((n, heads * d))?)
}

/// Keys or values `[kv_heads, n, d]` repeated for `heads` query heads (grouped-query attention).
fn grouped(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (kv_heads, n, d) = t.dims3()?;
    Ok(t.unsqueeze(1)?.broadcast_as((kv_heads, heads / kv_heads, n, d))?.reshape((heads, n, d))?)
}
