//! The ops training differentiates through, composed of candle's primitive ops: candle-nn's fused kernels, which
//! the inference forward uses, have no backward pass. Training runs in f32 on the CPU.

use crate::engine::candle::llama::{causal_mask, RopeTables};
use anyhow::Result;
use candle_core::{Tensor, D};

pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm_slow(x, w, eps as f32)?)
}

fn softmax(x: &Tensor) -> Result<Tensor> {
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

/// Attention of draft step j = `earlier.len()` of a chain unrolled along a sequence (EAGLE-3's training-time test):
/// query row i stands for the j-th draft after the true-feature row i − j, so it attends, as drafting does, to the
/// true-feature rows 0..=i − j (`earlier[0]`), to the row each step 0 < k < j computed in the same chain (row
/// i − j + k of `earlier[k]`) and to its own row `k_own`, `v_own`. Keys and values `[kv_heads, n, d]`, queries
/// `[heads, n, d]`; returns `[n, heads · d]`. Rows i < j have no such chain; they are computed and never counted.
pub fn attention_unrolled(q: &Tensor, earlier: &[(Tensor, Tensor)], k_own: &Tensor, v_own: &Tensor) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let j = earlier.len();
    let scale = (d as f64).sqrt();
    let (k0, v0) = (grouped(&earlier[0].0, heads)?, grouped(&earlier[0].1, heads)?);
    let mask: Vec<f32> = (0..n).flat_map(|i| (0..n).map(move |r| if r + j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mut scores = vec![(q.matmul(&k0.t()?)? / scale)?.broadcast_add(&Tensor::from_vec(mask, (n, n), q.device())?)?];
    // The chain's own rows, moved down so that row i holds the one query i attends to.
    let chain = earlier[1..].iter().enumerate().map(|(k, (kk, vv))| (kk, vv, j - 1 - k)).chain(std::iter::once((k_own, v_own, 0)));
    let mut values = Vec::with_capacity(j);
    for (kk, vv, shift) in chain {
        let kk = grouped(&shifted_down(kk, shift)?, heads)?;
        scores.push(((q * &kk)?.sum_keepdim(2)? / scale)?);
        values.push(grouped(&shifted_down(vv, shift)?, heads)?);
    }
    let p = softmax(&Tensor::cat(&scores, 2)?)?;
    let mut out = p.narrow(2, 0, n)?.matmul(&v0)?;
    for (k, v) in values.iter().enumerate() {
        out = (out + p.narrow(2, n + k, 1)?.broadcast_mul(v)?)?;
    }
    Ok(out.transpose(0, 1)?.reshape((n, heads * d))?)
}

/// Rows of `t` `[kv_heads, n, d]` moved `by` rows down, zeros above.
fn shifted_down(t: &Tensor, by: usize) -> Result<Tensor> {
    let n = t.dim(1)?;
    if by == 0 {
        return Ok(t.clone());
    }
    let zeros = t.narrow(1, 0, by.min(n))?.zeros_like()?;
    if by >= n {
        return Ok(zeros);
    }
    Ok(Tensor::cat(&[&zeros, &t.narrow(1, 0, n - by)?], 1)?)
}

/// Keys or values `[kv_heads, n, d]` repeated for `heads` query heads (grouped-query attention).
fn grouped(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (kv_heads, n, d) = t.dims3()?;
    Ok(t.unsqueeze(1)?.broadcast_as((kv_heads, heads / kv_heads, n, d))?.reshape((heads, n, d))?)
}
