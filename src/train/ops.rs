//! The ops training differentiates through, composed of candle's primitive ops: candle-nn's fused kernels, which
//! the inference forward uses, have no backward pass. Training runs in f32 on the CPU.

use crate::engine::candle::llama::RopeTables;
use crate::engine::cpu::exp::exp_in_place;
use anyhow::Result;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

/// RMS norm of the rows of `x` (over its last dimension) times `w`, with the forward bits of candle-nn's composed
/// `rms_norm_slow` (x / √(Σx²/h + ε) · w) in one pass a row, and a backward of two passes; composed, it was six
/// tensors each way, each gradient allocated, zeroed and added by candle's backward.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })?)
}

#[derive(Clone, Copy)]
struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    /// The values of `x` (rows as wide as `w`), of `w`, and that width.
    fn rows<'a>(&self, s1: &'a CpuStorage, l1: &Layout, s2: &'a CpuStorage, l2: &Layout) -> candle_core::Result<(&'a [f32], &'a [f32], usize)> {
        let (x, w) = (f32_values(s1, l1, "rms norm: its input")?, f32_values(s2, l2, "rms norm: its weight")?);
        let h = w.len();
        if l1.dims().last() != Some(&h) || h == 0 {
            candle_core::bail!("rms norm: input {:?} against a weight {:?}", l1.dims(), l2.dims());
        }
        Ok((x, w, h))
    }

    /// A row's √(Σx²/h + ε) as candle's ops compute it; `scratch` is as wide as the row.
    fn root_mean_square(&self, x: &[f32], scratch: &mut [f32]) -> f32 {
        scratch.iter_mut().zip(x).for_each(|(s, &x)| *s = x * x);
        let mean = row_sum(scratch) * (1.0 / x.len() as f64) as f32;
        (mean + self.eps).sqrt()
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, h) = self.rows(s1, l1, s2, l2)?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(y, x)| {
            let rms = self.root_mean_square(x, y);
            y.iter_mut().zip(x).zip(w).for_each(|((y, &x), &w)| *y = x / rms * w);
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let of = |input| x.apply_op3_no_bwd(w, &grad, &RmsNormGrad { norm: *self, input });
        Ok((Some(of(true)?), Some(of(false)?)))
    }
}

/// A gradient of `RmsNorm` given x, w and the output's gradient g, with r = √(Σx²/h + ε) a row: of the input
/// (`input`), w·g / r − x · Σ(w·g·x) / (h r³) a row, or of the weight, Σ over rows of g · x / r.
struct RmsNormGrad {
    norm: RmsNorm,
    input: bool,
}

/// Rows a block of the weight's gradient sums before the blocks are added in order: a fixed split, so that the sum,
/// and so training, does not depend on how rayon shares the blocks out.
const ROWS_A_BLOCK: usize = 64;

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, h) = self.norm.rows(s1, l1, s2, l2)?;
        let g = f32_values(s3, l3, "rms norm: its gradient")?;
        if g.len() != x.len() {
            candle_core::bail!("rms norm: input {:?} against a gradient {:?}", l1.dims(), l3.dims());
        }
        if self.input {
            let mut dx = vec![0f32; x.len()];
            dx.par_chunks_mut(h).zip(x.par_chunks(h)).zip(g.par_chunks(h)).for_each(|((dx, x), g)| {
                let rms = self.norm.root_mean_square(x, dx);
                let dot: f32 = x.iter().zip(g).zip(w).map(|((x, g), w)| x * g * w).sum();
                let along = dot / (h as f32 * rms * rms * rms);
                dx.iter_mut().zip(x).zip(g.iter().zip(w)).for_each(|((dx, &x), (&g, &w))| *dx = w * g / rms - x * along);
            });
            return Ok((CpuStorage::F32(dx), l1.shape().clone()));
        }
        let blocks: Vec<Vec<f32>> = x
            .par_chunks(h * ROWS_A_BLOCK)
            .zip(g.par_chunks(h * ROWS_A_BLOCK))
            .map(|(x, g)| {
                let (mut dw, mut scratch) = (vec![0f32; h], vec![0f32; h]);
                for (x, g) in x.chunks(h).zip(g.chunks(h)) {
                    let rms = self.norm.root_mean_square(x, &mut scratch);
                    dw.iter_mut().zip(x).zip(g).for_each(|((dw, &x), &g)| *dw += g * x / rms);
                }
                dw
            })
            .collect();
        let dw = blocks.into_iter().reduce(|mut sum, block| {
            sum.iter_mut().zip(block).for_each(|(s, b)| *s += b);
            sum
        });
        Ok((CpuStorage::F32(dw.unwrap_or_else(|| vec![0.0; h])), l2.shape().clone()))
    }
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
    let p = masked_softmax(&q.matmul(&k.t()?)?, d, Seen { block: total, offset: start as isize + 1 })?;
    Ok(p.matmul(&v)?.transpose(0, 1)?.reshape((n, heads * d))?)
}

/// Attention of draft step j = `earlier.len()` of a chain unrolled along a sequence (EAGLE-3's training-time test),
/// at the sequence's rows from `start` on: query row i stands for the j-th draft after the true-feature row i − j,
/// so it attends, as drafting does, to the true-feature rows 0..=i − j (`earlier[0]`, every row of the sequence), to
/// the row each step 0 < k < j computed in the same chain (row i − j + k of `earlier[k]`, whose rows start at
/// `start` too) and to its own row `k_own`, `v_own`. Keys and values `[kv_heads, rows, d]`, queries
/// `[heads, n, d]`; returns `[n, heads · d]`. Rows whose chain reaches before `start` (or before the sequence: i < j)
/// have no such chain; they are computed and never counted.
pub fn attention_unrolled(q: &Tensor, start: usize, earlier: &[(Tensor, Tensor)], k_own: &Tensor, v_own: &Tensor) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let j = earlier.len();
    let (k0, v0) = (grouped(&earlier[0].0, heads)?, grouped(&earlier[0].1, heads)?);
    let block = k0.dim(1)?;
    let mut scores = vec![q.matmul(&k0.t()?)?];
    // The chain's own rows, moved down so that row i holds the one query i attends to.
    let chain = earlier[1..].iter().enumerate().map(|(k, (kk, vv))| (kk, vv, j - 1 - k)).chain(std::iter::once((k_own, v_own, 0)));
    let mut values = Vec::with_capacity(j);
    for (kk, vv, shift) in chain {
        let kk = grouped(&shifted_down(kk, shift)?, heads)?;
        scores.push((q * &kk)?.sum_keepdim(2)?);
        values.push(grouped(&shifted_down(vv, shift)?, heads)?);
    }
    // Row i sees the true-feature rows 0..=i − j and every chain column.
    let p = masked_softmax(&Tensor::cat(&scores, 2)?, d, Seen { block, offset: start as isize + 1 - j as isize })?;
    let mut out = p.narrow(2, 0, block)?.matmul(&v0)?;
    for (k, v) in values.iter().enumerate() {
        out = (out + p.narrow(2, block + k, 1)?.broadcast_mul(v)?)?;
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

/// Which columns of a row of attention scores `[heads, n, width]` its query sees: in row i, the first i + `offset`
/// of the first `block` columns (none when that is negative, all when it passes `block`) and every column after them.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    pub block: usize,
    pub offset: isize,
}

impl Seen {
    /// The columns row `row` sees: the first of the block's, and those after the block (of `width`).
    fn columns(self, row: usize, width: usize) -> [std::ops::Range<usize>; 2] {
        [0..(row as isize + self.offset).clamp(0, self.block as isize) as usize, self.block..width]
    }
}

/// softmax(scores / √`head_dim`), the columns a query does not see (`seen`) left out, over the last dimension of
/// `scores` `[heads, n, width]`, with the forward bits of candle's composed ops (scale, −∞ mask, max, exp, row sum,
/// division) in one pass a row. Composed, they were seven `[heads, n, width]` tensors each way, and candle's backward
/// allocates, zeroes and adds a gradient for every one of them: a third of a training step's elementwise work.
pub fn masked_softmax(scores: &Tensor, head_dim: usize, seen: Seen) -> Result<Tensor> {
    Ok(scores.contiguous()?.apply_op1(MaskedSoftmax { inv_scale: (1.0 / (head_dim as f64).sqrt()) as f32, seen })?)
}

struct MaskedSoftmax {
    inv_scale: f32,
    seen: Seen,
}

impl MaskedSoftmax {
    /// The rows of a contiguous `[heads, n, width]` operand, with n and the width.
    fn rows<'a>(&self, s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<(&'a [f32], usize, usize)> {
        let &[_, n, width] = l.dims() else {
            candle_core::bail!("masked softmax: {what} must be [heads, n, width], not {:?}", l.dims())
        };
        if width < self.seen.block || width == 0 {
            candle_core::bail!("masked softmax: {what} {:?} narrower than the masked block of {}", l.dims(), self.seen.block);
        }
        Ok((f32_values(s, l, what)?, n, width))
    }
}

impl CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (scores, n, width) = self.rows(s, l, "the scores")?;
        let mut p = vec![0f32; scores.len()];
        p.par_chunks_mut(width).zip(scores.par_chunks(width)).enumerate().for_each(|(r, (p, s))| {
            let seen = self.seen.columns(r % n, width);
            let mut max = f32::NEG_INFINITY;
            for columns in seen.clone() {
                for (p, &s) in p[columns.clone()].iter_mut().zip(&s[columns]) {
                    *p = s * self.inv_scale;
                    max = if max < *p { *p } else { max };
                }
            }
            // Hidden columns stay 0, as exp(−∞ − max) made them: the row sum adds them where candle's did.
            for columns in seen {
                let p = &mut p[columns];
                p.iter_mut().for_each(|p| *p -= max);
                exp_in_place(p);
            }
            let sum = row_sum(p);
            p.iter_mut().for_each(|p| *p /= sum);
        });
        Ok((CpuStorage::F32(p), l.shape().clone()))
    }

    fn bwd(&self, _scores: &Tensor, p: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(p.apply_op2_no_bwd(&grad.contiguous()?, &MaskedSoftmaxGrad { inv_scale: self.inv_scale })?))
    }
}

/// The gradient of `MaskedSoftmax` with respect to its scores, given its output p and its gradient g:
/// p · (g − Σ p g) / √d a row (0 where p is: the hidden columns).
struct MaskedSoftmaxGrad {
    inv_scale: f32,
}

impl CustomOp2 for MaskedSoftmaxGrad {
    fn name(&self) -> &'static str {
        "masked-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (p, g) = (f32_values(s1, l1, "masked softmax: its output")?, f32_values(s2, l2, "masked softmax: its gradient")?);
        let width = l1.dims().last().copied().unwrap_or(0);
        if p.len() != g.len() || width == 0 {
            candle_core::bail!("masked softmax: output {:?} against a gradient {:?}", l1.dims(), l2.dims());
        }
        let mut out = vec![0f32; p.len()];
        out.par_chunks_mut(width).zip(p.par_chunks(width)).zip(g.par_chunks(width)).for_each(|((out, p), g)| {
            let dot: f32 = p.iter().zip(g).map(|(p, g)| p * g).sum();
            out.iter_mut().zip(p).zip(g).for_each(|((o, &p), &g)| *o = p * (g - dot) * self.inv_scale);
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// `x` `[rows, k]` times the transpose of `w` `[n, k]`, where `w` is frozen (the target's LM head): the same product
/// as `x.matmul(&w.t())`, but its backward computes only the gradient of `x`. candle's matmul backward computes both
/// operands' gradients whether or not one is trained, and the LM head's is as costly as the product itself. `w` is
/// detached so that backprop never walks into it: were it a variable, candle would wait for a gradient of it that
/// this op does not give.
pub fn frozen_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.apply_op2(&w.detach().t()?, FrozenProduct)?)
}

struct FrozenProduct;

impl CustomOp2 for FrozenProduct {
    fn name(&self) -> &'static str {
        "frozen-product"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (&[m, k], &[k2, n]) = (l1.dims(), l2.dims()) else {
            candle_core::bail!("frozen product: {:?} times {:?}, not two matrices", l1.dims(), l2.dims())
        };
        if k != k2 {
            candle_core::bail!("frozen product: {:?} times {:?}", l1.dims(), l2.dims());
        }
        Ok((s1.matmul(s2, (1, m, n, k), l1, l2)?, Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, wt: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.matmul(&wt.t()?)?), None))
    }
}

/// A teacher's distributions softmax(z) over the rows of `logits` `[rows, V]` (no gradient), each row's entropy and
/// argmax (the first of equal maxima).
pub struct Distributions {
    pub p: Tensor,
    pub entropy: Tensor,
    pub argmax: Tensor,
}

/// `Distributions` of `logits` with the arithmetic, and so the bits, of candle's composed ops (log-softmax as
/// z − max − ln Σ exp(z − max), p = exp of it, entropy −Σ p · log p by candle's own row sum, argmax of p), in one
/// pass a row side by side on rayon's threads. Composed, they were eight passes and five fresh `[rows, V]` tensors
/// (V up to 49,152) every step, about a tenth of a whole-vocabulary training step.
pub fn distributions(logits: &Tensor) -> Result<Distributions> {
    let logits = logits.contiguous()?;
    let (storage, layout) = logits.storage_and_layout();
    let candle_core::Storage::Cpu(storage) = &*storage else { anyhow::bail!("teacher distributions: logits must be on the CPU") };
    let (z, v) = f32_rows(storage, layout, "teacher distributions: the logits")?;
    anyhow::ensure!(v > 0, "teacher distributions: logits {:?} have no vocabulary", layout.dims());
    let rows = z.len() / v;
    let mut p = vec![0f32; z.len()];
    let mut entropy = vec![0f32; rows];
    let mut argmax = vec![0u32; rows];
    p.par_chunks_mut(v).zip(z.par_chunks(v)).zip(entropy.par_iter_mut().zip(argmax.par_iter_mut())).for_each_init(
        || vec![0f32; v],
        |scratch, ((p, z), (entropy, argmax))| {
            let max = z.iter().copied().fold(z[0], |m, x| if m < x { x } else { m });
            scratch.iter_mut().zip(z).for_each(|(e, &z)| *e = z - max);
            exp_in_place(scratch);
            let log_sum = row_sum(scratch).ln();
            let log_p = |z: f32| (z - max) - log_sum;
            p.iter_mut().zip(z).for_each(|(p, &z)| *p = log_p(z));
            exp_in_place(p);
            scratch.iter_mut().zip(p.iter()).zip(z).for_each(|((pl, p), &z)| *pl = p * log_p(z));
            *entropy = -row_sum(scratch);
            let mut best = 0;
            for (i, &x) in p.iter().enumerate() {
                if p[best] < x {
                    best = i;
                }
            }
            *argmax = best as u32;
        },
    );
    let dev = logits.device();
    Ok(Distributions { p: Tensor::from_vec(p, (rows, v), dev)?, entropy: Tensor::from_vec(entropy, rows, dev)?, argmax: Tensor::from_vec(argmax, rows, dev)? })
}

/// The sum of a row as candle's `sum_keepdim` over the last dimension takes it (its vectorized kernel).
fn row_sum(x: &[f32]) -> f32 {
    use candle_core::cpu::kernels::VecOps;
    let mut sum = 0f32;
    // SAFETY: `x` holds `x.len()` values and `sum` is one valid f32.
    unsafe { f32::vec_reduce_sum(x.as_ptr(), &mut sum, x.len()) };
    sum
}

/// Each row's cross-entropy −Σ_j p_j log softmax(z)_j of the logits `z` (`logits` `[rows, V]`) against the teacher
/// distribution `p` (`[rows, V]`, no gradient): `[rows]`. One fused pass a row forward and one backward (the gradient
/// is (softmax(z) · Σp − p) times the row's incoming gradient): composed of candle's ops, the log-softmax, product
/// and sum took about a dozen `[rows, V]` tensors each way (V up to 49,152), each allocated and zeroed, every
/// objective of every step.
pub fn soft_cross_entropy(logits: &Tensor, p: &Tensor) -> Result<Tensor> {
    Ok(logits.apply_op2(p, SoftCrossEntropy)?)
}

struct SoftCrossEntropy;

/// The values of a contiguous f32 operand (`what`: the op and which of its operands, for the error).
fn f32_values<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let (CpuStorage::F32(x), Some((o, e))) = (s, l.contiguous_offsets()) else {
        candle_core::bail!("{what} must be contiguous f32")
    };
    Ok(&x[o..e])
}

/// The rows of a contiguous f32 `[rows, V]` operand, and V.
fn f32_rows<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<(&'a [f32], usize)> {
    let &[_, v] = l.dims() else {
        candle_core::bail!("{what} must be [rows, vocabulary], not {:?}", l.dims())
    };
    Ok((f32_values(s, l, what)?, v))
}

/// A row's log-sum-exp: exponentials in f32 (as candle's ops took them), their sum in f64.
fn log_sum_exp(z: &[f32]) -> f64 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut exps = [0f32; 256];
    let mut sum = 0f64;
    for z in z.chunks(exps.len()) {
        let exps = &mut exps[..z.len()];
        exps.iter_mut().zip(z).for_each(|(e, &x)| *e = x - max);
        exp_in_place(exps);
        sum = exps.iter().fold(sum, |sum, &e| sum + e as f64);
    }
    max as f64 + sum.ln()
}

impl CustomOp2 for SoftCrossEntropy {
    fn name(&self) -> &'static str {
        "soft-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((z, v), (p, pv)) = (f32_rows(s1, l1, "soft cross-entropy: the logits")?, f32_rows(s2, l2, "soft cross-entropy: the teacher distribution")?);
        if (v, z.len()) != (pv, p.len()) || v == 0 {
            candle_core::bail!("soft cross-entropy: logits {:?} against a teacher distribution {:?}", l1.dims(), l2.dims());
        }
        // lse(z) · Σp − Σ p z: −Σ p (z − lse(z)) without a log-softmax row.
        let ce = z
            .par_chunks(v)
            .zip(p.par_chunks(v))
            .map(|(z, p)| {
                let (mass, dot) = p.iter().zip(z).fold((0f64, 0f64), |(m, d), (&p, &z)| (m + p as f64, d + p as f64 * z as f64));
                (log_sum_exp(z) * mass - dot) as f32
            })
            .collect();
        Ok((CpuStorage::F32(ce), Shape::from(z.len() / v)))
    }

    fn bwd(&self, logits: &Tensor, p: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(logits.apply_op3_no_bwd(p, &grad.contiguous()?, &SoftCrossEntropyGrad)?), None))
    }
}

/// The gradient of `SoftCrossEntropy` with respect to the logits, given the logits, p and the rows' gradients.
struct SoftCrossEntropyGrad;

impl CustomOp3 for SoftCrossEntropyGrad {
    fn name(&self) -> &'static str {
        "soft-cross-entropy-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((z, v), (p, _)) = (f32_rows(s1, l1, "soft cross-entropy: the logits")?, f32_rows(s2, l2, "soft cross-entropy: the teacher distribution")?);
        let g = f32_values(s3, l3, "soft cross-entropy: the rows' gradients")?;
        let mut out = vec![0f32; z.len()];
        out.par_chunks_mut(v).zip(z.par_chunks(v)).zip(p.par_chunks(v)).zip(g.par_iter()).for_each(|(((out, z), p), &g)| {
            let lse = log_sum_exp(z) as f32;
            let mass = p.iter().map(|&p| p as f64).sum::<f64>() as f32;
            out.iter_mut().zip(z).for_each(|(o, &z)| *o = z - lse);
            exp_in_place(out);
            out.iter_mut().zip(p).for_each(|(o, &p)| *o = g * (*o * mass - p));
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn floats(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Whether `seen` hides column `column` from row `row`.
    fn hides(seen: Seen, row: usize, column: usize) -> bool {
        !seen.columns(row, column + 1).iter().any(|columns| columns.contains(&column))
    }

    /// The masked softmax as candle's ops composed it before: scores / √d, plus a −∞ mask, candle-nn's softmax.
    fn composed_masked_softmax(scores: &Tensor, head_dim: usize, seen: Seen) -> Tensor {
        let (_, n, width) = scores.dims3().unwrap();
        let mask: Vec<f32> = (0..n).flat_map(|i| (0..width).map(move |c| if hides(seen, i, c) { f32::NEG_INFINITY } else { 0.0 })).collect();
        let scaled = (scores / (head_dim as f64).sqrt()).unwrap();
        let masked = scaled.broadcast_add(&Tensor::from_vec(mask, (n, width), scores.device()).unwrap()).unwrap();
        candle_nn::ops::softmax(&masked, D::Minus1).unwrap()
    }

    #[test]
    fn the_fused_rms_norm_equals_candles_composed_ops_in_bits_and_gradient() {
        // Rows of very different scales, more of them than a block of the weight's gradient sums.
        let dev = Device::Cpu;
        let (rows, h) = (ROWS_A_BLOCK + 7, 40);
        let values: Vec<f32> = (0..rows * h).map(|i| ((i * 37 % 23) as f32 - 11.0) * [0.001, 0.7, 30.0][i / h % 3]).collect();
        let weights = Tensor::from_vec((0..rows * h).map(|i| ((i * 7 % 5) as f32) - 2.0).collect::<Vec<f32>>(), (rows, h), &dev).unwrap();
        let run = |fused: bool| {
            let x = Var::from_vec(values.clone(), (rows, h), &dev).unwrap();
            let w = Var::from_vec((0..h).map(|i| 0.5 + (i as f32 * 0.3).sin()).collect(), h, &dev).unwrap();
            let y = if fused { rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap() } else { candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5).unwrap() };
            let grads = y.mul(&weights).unwrap().sum_all().unwrap().backward().unwrap();
            (floats(&y), floats(grads.get(x.as_tensor()).unwrap()), floats(grads.get(w.as_tensor()).unwrap()))
        };
        let ((y, dx, dw), (composed_y, composed_dx, composed_dw)) = (run(true), run(false));
        assert_eq!(bits(&y), bits(&composed_y));
        for (fused, composed) in [(&dx, &composed_dx), (&dw, &composed_dw)] {
            for (f, c) in fused.iter().zip(composed.iter()) {
                assert!((f - c).abs() <= 1e-4 * c.abs().max(1.0), "{fused:?}\nagainst\n{composed:?}");
            }
            assert!(fused.iter().any(|g| g.abs() > 1e-2), "{fused:?}");
        }
    }

    #[test]
    fn the_masked_softmax_equals_candles_composed_ops_in_bits_and_gradient() {
        // Causal attention from a start past 0, and the training-time test's second step: rows 0 and 1 see none of
        // the block, only the two chain columns after it.
        let dev = Device::Cpu;
        for (n, width, seen) in [(5, 8, Seen { block: 8, offset: 4 }), (6, 8, Seen { block: 6, offset: -1 }), (1, 40, Seen { block: 40, offset: 40 })] {
            let values: Vec<f32> = (0..3 * n * width).map(|i| ((i * 37 % 29) as f32 - 14.0) * [0.1, 1.5, 12.0][i % 3]).collect();
            let weights = Tensor::from_vec((0..3 * n * width).map(|i| ((i * 7 % 5) as f32) - 2.0).collect::<Vec<f32>>(), (3, n, width), &dev).unwrap();
            let run = |fused: bool| {
                let x = Var::from_vec(values.clone(), (3, n, width), &dev).unwrap();
                let p = if fused { masked_softmax(x.as_tensor(), 64, seen).unwrap() } else { composed_masked_softmax(x.as_tensor(), 64, seen) };
                let grads = p.mul(&weights).unwrap().sum_all().unwrap().backward().unwrap();
                (floats(&p), floats(grads.get(x.as_tensor()).unwrap()))
            };
            let ((p, grad), (composed_p, composed_grad)) = (run(true), run(false));
            assert_eq!(bits(&p), bits(&composed_p), "{seen:?}");
            for (f, c) in grad.iter().zip(&composed_grad) {
                assert!((f - c).abs() < 1e-6, "{seen:?}: {grad:?}\nagainst\n{composed_grad:?}");
            }
            assert!(grad.iter().any(|g| g.abs() > 1e-3), "{grad:?}");
            assert!((0..3 * n).all(|r| (0..width).all(|c| !hides(seen, r % n, c) || p[r * width + c] == 0.0)));
        }
    }

    #[test]
    fn the_fused_cross_entropy_equals_candles_ops_in_value_and_gradient() {
        // Rows of different scales, a teacher with an underflowed probability, and rows weighted differently by
        // what follows the op, so that each row's incoming gradient matters.
        let dev = Device::Cpu;
        let z: Vec<f32> = (0..3 * 7).map(|i| ((i * 37 % 11) as f32 - 5.0) * [0.3, 2.0, 9.0][i / 7]).collect();
        let teacher: Vec<f32> = (0..3 * 7).map(|i| ((i * 13 % 7) as f32 - 3.0) * if i == 4 { 60.0 } else { 1.5 }).collect();
        let p = candle_nn::ops::softmax(&Tensor::from_vec(teacher, (3, 7), &dev).unwrap(), D::Minus1).unwrap();
        let weights = Tensor::new(&[1.0f32, -2.0, 0.5], &dev).unwrap();
        let loss = |ce: Tensor| ce.mul(&weights).unwrap().sum_all().unwrap();

        let fused = Var::from_vec(z.clone(), (3, 7), &dev).unwrap();
        let fused_loss = loss(soft_cross_entropy(fused.as_tensor(), &p).unwrap());
        let fused_grad = fused_loss.backward().unwrap().get(fused.as_tensor()).unwrap().to_vec2::<f32>().unwrap();

        let composed = Var::from_vec(z, (3, 7), &dev).unwrap();
        let log_q = candle_nn::ops::log_softmax(composed.as_tensor(), D::Minus1).unwrap();
        let composed_loss = loss(p.mul(&log_q).unwrap().sum(1).unwrap().neg().unwrap());
        let composed_grad = composed_loss.backward().unwrap().get(composed.as_tensor()).unwrap().to_vec2::<f32>().unwrap();

        let (a, b) = (fused_loss.to_scalar::<f32>().unwrap(), composed_loss.to_scalar::<f32>().unwrap());
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{a} against {b}");
        for (f, c) in fused_grad.iter().flatten().zip(composed_grad.iter().flatten()) {
            assert!((f - c).abs() < 1e-5, "{fused_grad:?}\nagainst\n{composed_grad:?}");
        }
        assert!(fused_grad.iter().flatten().any(|g| g.abs() > 0.1), "{fused_grad:?}");
    }

    #[test]
    fn the_teacher_distributions_equal_candles_composed_ops_bit_for_bit() {
        // Widths off and on the row sum's 32-wide steps; rows of several scales, one with a tie for its maximum and
        // probabilities that underflow.
        let dev = Device::Cpu;
        for v in [7, 64, 1000] {
            let mut z: Vec<f32> = (0..4 * v).map(|i| ((i * 37 % 101) as f32 - 50.0) * [0.01, 0.3, 2.0, 40.0][i / v]).collect();
            z[v + 3] = z[v..2 * v].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let logits = Tensor::from_vec(z, (4, v), &dev).unwrap();
            let log_p = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
            let p = log_p.exp().unwrap();
            let entropy = p.mul(&log_p).unwrap().sum(1).unwrap().neg().unwrap();
            let fused = distributions(&logits).unwrap();
            assert_eq!(bits(&floats(&fused.p)), bits(&floats(&p)), "p at width {v}");
            assert_eq!(bits(&floats(&fused.entropy)), bits(&floats(&entropy)), "entropy at width {v}");
            assert_eq!(fused.argmax.to_vec1::<u32>().unwrap(), p.argmax(1).unwrap().to_vec1::<u32>().unwrap(), "argmax at width {v}");
            assert!(fused.entropy.to_vec1::<f32>().unwrap().iter().all(|&h| h >= 0.0 && h.is_finite()));
        }
    }

    #[test]
    fn the_frozen_product_equals_matmul_and_leaves_the_frozen_side_without_a_gradient() {
        let dev = Device::Cpu;
        let x = Var::from_vec((0..3 * 4).map(|i| (i as f32 * 0.7).sin()).collect(), (3, 4), &dev).unwrap();
        let w = Var::from_vec((0..5 * 4).map(|i| (i as f32 * 1.3).cos()).collect(), (5, 4), &dev).unwrap();
        let weights = Tensor::from_vec((0..15).map(|i| i as f32 - 7.0).collect::<Vec<f32>>(), (3, 5), &dev).unwrap();
        let frozen = frozen_product(x.as_tensor(), w.as_tensor()).unwrap();
        let plain = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        assert_eq!(frozen.to_vec2::<f32>().unwrap(), plain.to_vec2::<f32>().unwrap());
        let frozen_grads = frozen.mul(&weights).unwrap().sum_all().unwrap().backward().unwrap();
        let plain_grads = plain.mul(&weights).unwrap().sum_all().unwrap().backward().unwrap();
        let grad_x = |g: &candle_core::backprop::GradStore| g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(grad_x(&frozen_grads), grad_x(&plain_grads));
        assert!(plain_grads.get(w.as_tensor()).is_some());
        assert!(frozen_grads.get(w.as_tensor()).is_none());
    }

    #[test]
    fn the_fused_cross_entropy_names_a_mismatched_teacher() {
        let dev = Device::Cpu;
        let err = soft_cross_entropy(&Tensor::zeros((2, 5), candle_core::DType::F32, &dev).unwrap(), &Tensor::zeros((2, 4), candle_core::DType::F32, &dev).unwrap()).unwrap_err();
        assert!(err.to_string().contains("teacher distribution"), "{err}");
    }
}
