//! Fused ops of the candle engine's forward that neither candle nor candle-nn has: each one replaces several kernel
//! launches (and their output allocations) of a decode step. Written here because no crate offers them for candle;
//! the CUDA kernels are in kernels.cu (built to PTX by build.rs with feature `cuda`), and each op has a CPU twin
//! below, so the one forward runs on either device and the tests check it against the CPU engine. Arithmetic is in
//! f32 whatever the storage dtype.

use super::llama::RopeTables;
use crate::engine::cpu::model::RopeStyle;
use anyhow::Result;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp3, Layout, Shape, Tensor, WithDType};
use std::borrow::Cow;

/// Rotate the first `heads` heads (queries, then keys) of every row of `qkv` `[n, width]` in place, row i with
/// `rope`'s row i. One launch where RoPE of queries and of keys took two, plus copies. For attention by candle's
/// products; `write_kv` and `rows_attention` rotate as they read.
pub fn rotate_qk(qkv: &Tensor, rope: &RopeTables, heads: usize, head_dim: usize) -> Result<()> {
    Ok(qkv.inplace_op3(&rope.cos, &rope.sin, &RotateQk { heads, head_dim, interleaved: rope.style == RopeStyle::Interleaved })?)
}

/// SiLU(gate) × up of `gate_up` `[n, 2 · width]` (gate, then up): `[n, width]`.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    Ok(gate_up.apply_op1_no_bwd(&SiluMul)?)
}

/// The index of the largest value of each row of `x` (the last dimension; ties to the lower index, as
/// `crate::sampling::argmax`), `u32`: on a GPU in two launches over chunks of every row, where candle's argmax runs
/// one block a row.
pub fn argmax_rows(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let Some((&cols, outer)) = dims.split_last() else { anyhow::bail!("argmax of a scalar") };
    if x.elem_count() == 0 {
        return Ok(Tensor::zeros(outer, DType::U32, x.device())?);
    }
    // Rows a stride apart (a head's kept columns of a padded product) are read where they lie.
    let rows = if x.rank() == 2 && x.stride()[1] == 1 { x.clone() } else { x.contiguous()?.reshape((x.elem_count() / cols.max(1), cols))? };
    Ok(rows.apply_op1_no_bwd(&ArgmaxRows)?.reshape(outer)?)
}

/// Whether `x` · `w`ᵀ (and `others` beside them) runs through frspec's matrix-vector kernels: one row on a GPU, every
/// operand contiguous and 16-byte aligned, rows a multiple of 16 bytes.
fn takes_matvec(x: &Tensor, w: &Tensor, others: &[&Tensor]) -> Result<bool> {
    let aligned = |t: &Tensor| (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 == 0 && t.is_contiguous();
    let row_bytes = w.dim(1)? * w.dtype().size_in_bytes();
    Ok(x.device().is_cuda() && x.dims()[0] == 1 && row_bytes % 16 == 0 && aligned(x) && aligned(w) && others.iter().all(|t| aligned(t)))
}

/// `x · wᵀ` for `x` `[b, k]`, `w` `[n, k]`: for one row on a GPU frspec's matrix-vector kernel (`matvec`), else
/// candle's matmul (cuBLAS, or gemm on the CPU).
pub fn product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if takes_matvec(x, w, &[])? {
        return matvec(x, w);
    }
    Ok(x.matmul(&w.t()?)?)
}

/// `rms_norm(x, g) · wᵀ`: for one row on a GPU the norm is folded into the matrix-vector kernel (no launch of its
/// own, no normed row written), else candle-nn's norm and `product`.
pub fn normed_product(x: &Tensor, g: &Tensor, eps: f32, w: &Tensor) -> Result<Tensor> {
    if takes_matvec(x, w, &[g])? {
        return matvec_normed(x, g, eps, w);
    }
    product(&candle_nn::ops::rms_norm(x, g, eps)?, w)
}

/// `x · wᵀ + r`: for one row on a GPU the residual add is folded into the matrix-vector kernel.
pub fn product_plus(x: &Tensor, w: &Tensor, r: &Tensor) -> Result<Tensor> {
    if takes_matvec(x, w, &[r])? {
        return matvec_plus(x, w, r);
    }
    Ok((product(x, w)? + r)?)
}

/// `x · wᵀ` for one row `x` `[1, k]` and `w` `[n, k]`, both contiguous: `[1, n]`. On a GPU, k · dtype size must be a
/// multiple of 16 bytes and both operands 16-byte aligned (`product` checks).
pub fn matvec(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(w.apply_op2_no_bwd(x, &Matvec)?)
}

/// `matvec` of `rms_norm(x, g)` (`normed_product` checks the operands).
pub fn matvec_normed(x: &Tensor, g: &Tensor, eps: f32, w: &Tensor) -> Result<Tensor> {
    Ok(w.apply_op3_no_bwd(x, g, &MatvecWith(Fold::Norm(eps)))?)
}

/// `silu(rms_norm(x, g) · gateᵀ) × (rms_norm(x, g) · upᵀ)` for `w` `[2n, k]` holding the gate's rows, then the up's
/// (a stacked gate/up projection): `[rows, n]`. For one row on a GPU one warp reads a gate row and its up row, with the
/// norm and SiLU × up folded in (no launch of their own), else `normed_product` then `silu_mul`.
pub fn normed_swiglu(x: &Tensor, g: &Tensor, eps: f32, w: &Tensor) -> Result<Tensor> {
    if takes_matvec(x, w, &[g])? && w.dim(0)? % 2 == 0 {
        return Ok(w.apply_op3_no_bwd(x, g, &MatvecWith(Fold::NormSwiglu(eps)))?);
    }
    silu_mul(&normed_product(x, g, eps, w)?)
}

/// `matvec` plus `r` `[1, n]` (`product_plus` checks the operands).
pub fn matvec_plus(x: &Tensor, w: &Tensor, r: &Tensor) -> Result<Tensor> {
    Ok(w.apply_op3_no_bwd(x, r, &MatvecWith(Fold::Residual))?)
}

/// Write the keys and values of the rows of `qkv` `[rows, width]` (after `heads` query heads: `kv_heads` keys, then
/// as many values, each of `pool`'s head dimension) into `pool` `[slots, 2, kv_heads, capacity, d]`, row r at slot
/// `at[r][0]`, position `at[r][1]` (`at` `[rows, 2]`, u32). One launch for every row of every sequence of a forward,
/// with no copy of the rows first. With `rope` the keys are rotated on the way (row r with `rope`'s row r), as
/// `rotate_qk` would have rotated them in `qkv`; without, rows already rotated are copied.
pub fn write_kv(pool: &Tensor, qkv: &Tensor, at: &Tensor, heads: usize, rope: Option<&RopeTables>) -> Result<()> {
    Ok(pool.inplace_op3(qkv, at, &WriteKv { heads, rotation: rope.map(Rotation::of) })?)
}

/// The attention of every query row of `qkv` `[rows, width]` (its first `heads` heads) at its own place `at[r]`
/// (slot, position) over positions `0..=position` of that slot of `pool` `[slots, 2, kv_heads, capacity, d]`:
/// `[rows, heads · d]`. Rows of one sequence's block see the block's own keys up to themselves (written first by
/// `write_kv`), so no mask is needed; rows of several sequences go in one launch where scores, scale, softmax and
/// the weighted sum took four launches a sequence. `longest` bounds every row's position + 1. The queries in `qkv`
/// are not yet rotated: row r's are rotated with `rope`'s row r as they are read (the keys by `write_kv`), which
/// saves `rotate_qk`'s launch a layer.
pub fn rows_attention(qkv: &Tensor, pool: &Tensor, at: &Tensor, heads: usize, longest: usize, rope: &RopeTables) -> Result<Tensor> {
    Ok(qkv.apply_op3_no_bwd(pool, at, &RowsAttention { heads, longest, rotation: Rotation::of(rope) })?)
}

/// Whether `rows_attention` takes rows attending over up to `len` positions of head dimension `d` in `dtype`: its
/// scores live in 48 KiB of shared memory on a GPU (with the query row and `ATTENTION_THREADS` × 16 bytes of partial
/// sums), past a few thousand positions one block per head no longer keeps up, and its loads are 16-byte vectors of
/// a head's row.
pub fn rows_attention_fits(len: usize, d: usize, dtype: DType) -> bool {
    len <= 8192 && d <= 256 && (d * dtype.size_in_bytes()) % 16 == 0
}

struct RotateQk {
    heads: usize,
    head_dim: usize,
    interleaved: bool,
}

struct SiluMul;

struct ArgmaxRows;

struct Matvec;

/// A matrix-vector product with the RMSNorm of x before it (weights and eps), a residual added after it, or the norm
/// before and SiLU(gate) × up after (rows: gate, then up).
#[derive(Clone, Copy)]
enum Fold {
    Norm(f32),
    Residual,
    NormSwiglu(f32),
}

struct MatvecWith(Fold);

struct WriteKv {
    heads: usize,
    rotation: Option<Rotation>,
}

struct RowsAttention {
    heads: usize,
    longest: usize,
    rotation: Rotation,
}

/// RoPE's cos and sin `[rows, d / 2]` (f32) of a forward's rows, held by an op that rotates as it reads (candle's ops
/// take at most three operands, and these already have three).
struct Rotation {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Rotation {
    fn of(rope: &RopeTables) -> Rotation {
        Rotation { cos: rope.cos.clone(), sin: rope.sin.clone(), interleaved: rope.style == RopeStyle::Interleaved }
    }

    /// The tables' values on the host, for the CPU twins.
    fn angles(&self) -> candle_core::Result<Angles<'static>> {
        let values = |t: &Tensor| -> candle_core::Result<Cow<'static, [f32]>> { Ok(Cow::Owned(t.flatten_all()?.to_vec1()?)) };
        Ok(Angles { cos: values(&self.cos)?, sin: values(&self.sin)?, interleaved: self.interleaved })
    }
}

/// Row i of RoPE tables `cos`, `sin` `[rows, d / 2]` applied to a head of d values, in f32 (the kernels' rope_pair):
/// the tables borrowed from an operand (`rotate_qk`) or copied from a `Rotation`'s.
struct Angles<'a> {
    cos: Cow<'a, [f32]>,
    sin: Cow<'a, [f32]>,
    interleaved: bool,
}

impl Angles<'_> {
    /// Head `x` of row `i`, rotated, into `out` (f32).
    fn rotate<T: WithDType>(&self, i: usize, x: &[T], out: &mut [f32]) {
        let half = x.len() / 2;
        for j in 0..half {
            let (c, s) = (self.cos[i * half + j], self.sin[i * half + j]);
            let (a, b) = if self.interleaved { (2 * j, 2 * j + 1) } else { (j, j + half) };
            let (xa, xb) = (x[a].to_f64() as f32, x[b].to_f64() as f32);
            out[a] = xa * c - xb * s;
            out[b] = xa * s + xb * c;
        }
    }
}

/// A pool's dimensions `[slots, 2, kv_heads, capacity, d]` as (kv_heads, capacity, d).
fn pool_dims(l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match *l.dims() {
        [_, 2, kv_heads, capacity, d] => Ok((kv_heads, capacity, d)),
        ref other => candle_core::bail!("key/value pool must be [slots, 2, kv_heads, capacity, d], not {other:?}"),
    }
}

/// The (slot, position) pairs of `at` `[rows, 2]`, each checked to lie inside the pool of layout `pool` and below
/// `end` (what the GPU kernels take on trust: they index without bounds checks).
fn places(s: &CpuStorage, l: &Layout, pool: &Layout, end: usize, op: &str) -> candle_core::Result<Vec<(usize, usize)>> {
    let (o, e) = span(l, op)?;
    let CpuStorage::U32(at) = s else { candle_core::bail!("{op}: places are u32") };
    let (slots, capacity) = (pool.dims()[0], pool_dims(pool)?.1);
    let places: Vec<(usize, usize)> = at[o..e].chunks_exact(2).map(|p| (p[0] as usize, p[1] as usize)).collect();
    if let Some((slot, position)) = places.iter().find(|&&(slot, position)| slot >= slots || position >= capacity.min(end)) {
        candle_core::bail!("{op}: a row at slot {slot}, position {position} lies outside {slots} slots of {} positions", capacity.min(end));
    }
    Ok(places)
}

/// The contiguous elements a layout covers, or an error naming the op.
fn span(l: &Layout, op: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{op}: operand must be contiguous")))
}

impl InplaceOp3 for RotateQk {
    fn name(&self) -> &'static str {
        "rotate-qk"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<()> {
        let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, self.name())?, span(l2, self.name())?, span(l3, self.name())?);
        let (CpuStorage::F32(cos), CpuStorage::F32(sin)) = (s2, s3) else {
            candle_core::bail!("rotate-qk: cos and sin are f32")
        };
        let width = l1.dims()[1];
        let angles = Angles { cos: Cow::Borrowed(&cos[o2..e2]), sin: Cow::Borrowed(&sin[o3..e3]), interleaved: self.interleaved };
        match s1 {
            CpuStorage::F32(x) => self.rotate(&mut x[o1..e1], width, &angles),
            CpuStorage::BF16(x) => self.rotate(&mut x[o1..e1], width, &angles),
            CpuStorage::F16(x) => self.rotate(&mut x[o1..e1], width, &angles),
            _ => candle_core::bail!("rotate-qk: f32, bf16 or f16 rows"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout, s3: &candle_core::CudaStorage, l3: &Layout) -> candle_core::Result<()> {
        cuda::rotate_qk(self, s1, l1, s2, l2, s3, l3)
    }
}

impl RotateQk {
    fn rotate<T: WithDType>(&self, x: &mut [T], width: usize, angles: &Angles) {
        let mut rotated = vec![0f32; self.head_dim];
        for (i, row) in x.chunks_exact_mut(width).enumerate() {
            for head in row[..self.heads * self.head_dim].chunks_exact_mut(self.head_dim) {
                angles.rotate(i, head, &mut rotated);
                head.iter_mut().zip(&rotated).for_each(|(h, &r)| *h = T::from_f64(r as f64));
            }
        }
    }
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (o, e) = span(l, self.name())?;
        let (n, width) = (l.dims()[0], l.dims()[1] / 2);
        fn f<T: WithDType>(x: &[T], width: usize) -> Vec<T> {
            let silu = |g: f32| g / (1.0 + (-g).exp());
            x.chunks_exact(2 * width)
                .flat_map(|row| (0..width).map(move |c| T::from_f64((silu(row[c].to_f64() as f32) * row[width + c].to_f64() as f32) as f64)))
                .collect()
        }
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(f(&x[o..e], width)),
            CpuStorage::BF16(x) => CpuStorage::BF16(f(&x[o..e], width)),
            CpuStorage::F16(x) => CpuStorage::F16(f(&x[o..e], width)),
            _ => candle_core::bail!("silu-mul: f32, bf16 or f16 rows"),
        };
        Ok((out, Shape::from((n, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::silu_mul(s, l)
    }
}

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols, stride, o) = strided_rows(l)?;
        fn f<T: WithDType>(x: &[T], rows: usize, cols: usize, stride: usize, o: usize) -> Vec<u32> {
            let row = |r: usize| x[o + r * stride..o + r * stride + cols].iter().map(|v| v.to_f64() as f32);
            (0..rows).map(|r| crate::sampling::argmax_of(row(r))).collect()
        }
        let out = match s {
            CpuStorage::F32(x) => f(x, rows, cols, stride, o),
            CpuStorage::BF16(x) => f(x, rows, cols, stride, o),
            CpuStorage::F16(x) => f(x, rows, cols, stride, o),
            _ => candle_core::bail!("argmax-rows: f32, bf16 or f16 rows"),
        };
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::argmax_rows(s, l)
    }
}

/// A layout of rows `[rows, cols]` whose values are contiguous, each row `stride` apart from the one before, the first
/// at offset `o`: (rows, cols, stride, o).
fn strided_rows(l: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[rows, cols], &[stride, 1]) => Ok((rows, cols, stride, l.start_offset())),
        (dims, _) => candle_core::bail!("argmax-rows: rows [n, cols] of contiguous values, not {dims:?} as laid out"),
    }
}

impl CustomOp2 for Matvec {
    fn name(&self) -> &'static str {
        "matvec"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((o1, e1), (o2, e2)) = (span(l1, self.name())?, span(l2, self.name())?);
        let (n, k) = (l1.dims()[0], l1.dims()[1]);
        fn f<T: WithDType>(w: &[T], x: &[T], k: usize) -> Vec<T> {
            w.chunks_exact(k).map(|row| T::from_f64(row.iter().zip(x).map(|(a, b)| a.to_f64() as f32 * b.to_f64() as f32).sum::<f32>() as f64)).collect()
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(w), CpuStorage::F32(x)) => CpuStorage::F32(f(&w[o1..e1], &x[o2..e2], k)),
            (CpuStorage::BF16(w), CpuStorage::BF16(x)) => CpuStorage::BF16(f(&w[o1..e1], &x[o2..e2], k)),
            (CpuStorage::F16(w), CpuStorage::F16(x)) => CpuStorage::F16(f(&w[o1..e1], &x[o2..e2], k)),
            _ => candle_core::bail!("matvec: f32, bf16 or f16 operands of one dtype"),
        };
        Ok((out, Shape::from((1, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::matvec(s1, l1, s2, l2)
    }
}

impl CustomOp3 for MatvecWith {
    fn name(&self) -> &'static str {
        match self.0 {
            Fold::Norm(_) => "norm-matvec",
            Fold::Residual => "matvec-add",
            Fold::NormSwiglu(_) => "norm-swiglu-matvec",
        }
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, self.name())?, span(l2, self.name())?, span(l3, self.name())?);
        let k = l1.dims()[1];
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(w), CpuStorage::F32(x), CpuStorage::F32(z)) => CpuStorage::F32(self.apply(&w[o1..e1], &x[o2..e2], &z[o3..e3], k)),
            (CpuStorage::BF16(w), CpuStorage::BF16(x), CpuStorage::BF16(z)) => CpuStorage::BF16(self.apply(&w[o1..e1], &x[o2..e2], &z[o3..e3], k)),
            (CpuStorage::F16(w), CpuStorage::F16(x), CpuStorage::F16(z)) => CpuStorage::F16(self.apply(&w[o1..e1], &x[o2..e2], &z[o3..e3], k)),
            _ => candle_core::bail!("{}: f32, bf16 or f16 operands of one dtype", self.name()),
        };
        Ok((out, Shape::from((1, self.0.outputs(l1.dims()[0])))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout, s3: &candle_core::CudaStorage, l3: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::matvec_with(self.0, s1, l1, s2, l2, s3, l3)
    }
}

impl Fold {
    /// Output values of a product of `rows` weight rows.
    fn outputs(self, rows: usize) -> usize {
        match self {
            Fold::NormSwiglu(_) => rows / 2,
            Fold::Norm(_) | Fold::Residual => rows,
        }
    }
}

impl MatvecWith {
    /// `z` is the norm's weights or the residual.
    fn apply<T: WithDType>(&self, w: &[T], x: &[T], z: &[T], k: usize) -> Vec<T> {
        let f = |v: &T| v.to_f64() as f32;
        let normed = |eps: f32, wr: &[T]| {
            let scale = 1.0 / (x.iter().map(|v| f(v).powi(2)).sum::<f32>() / k as f32 + eps).sqrt();
            wr.iter().zip(x).zip(z).map(|((a, b), g)| f(a) * f(b) * f(g)).sum::<f32>() * scale
        };
        let rows: Vec<&[T]> = w.chunks_exact(k).collect();
        (0..self.0.outputs(rows.len()))
            .map(|row| {
                let y = match self.0 {
                    Fold::Norm(eps) => normed(eps, rows[row]),
                    Fold::Residual => rows[row].iter().zip(x).map(|(a, b)| f(a) * f(b)).sum::<f32>() + f(&z[row]),
                    Fold::NormSwiglu(eps) => {
                        let (gate, up) = (normed(eps, rows[row]), normed(eps, rows[row + rows.len() / 2]));
                        gate / (1.0 + (-gate).exp()) * up
                    }
                };
                T::from_f64(y as f64)
            })
            .collect()
    }
}

impl InplaceOp3 for WriteKv {
    fn name(&self) -> &'static str {
        "write-kv"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<()> {
        let ((o1, e1), (o2, e2)) = (span(l1, self.name())?, span(l2, self.name())?);
        let (kv_heads, capacity, d) = pool_dims(l1)?;
        let (width, places) = (l2.dims()[1], places(s3, l3, l1, usize::MAX, self.name())?);
        let shape = PoolShape { heads: self.heads, kv_heads, capacity, d };
        let angles = self.rotation.as_ref().map(Rotation::angles).transpose()?;
        let angles = angles.as_ref();
        match (s1, s2) {
            (CpuStorage::F32(pool), CpuStorage::F32(qkv)) => shape.write(&mut pool[o1..e1], &qkv[o2..e2], width, &places, angles),
            (CpuStorage::BF16(pool), CpuStorage::BF16(qkv)) => shape.write(&mut pool[o1..e1], &qkv[o2..e2], width, &places, angles),
            (CpuStorage::F16(pool), CpuStorage::F16(qkv)) => shape.write(&mut pool[o1..e1], &qkv[o2..e2], width, &places, angles),
            _ => candle_core::bail!("write-kv: f32, bf16 or f16 operands of one dtype"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout, s3: &candle_core::CudaStorage, l3: &Layout) -> candle_core::Result<()> {
        cuda::write_kv(self, s1, l1, s2, l2, s3, l3)
    }
}

impl CustomOp3 for RowsAttention {
    fn name(&self) -> &'static str {
        "rows-attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((o1, e1), (o2, e2)) = (span(l1, self.name())?, span(l2, self.name())?);
        let (kv_heads, capacity, d) = pool_dims(l2)?;
        let (rows, width, places) = (l1.dims()[0], l1.dims()[1], places(s3, l3, l2, self.longest, self.name())?);
        let shape = PoolShape { heads: self.heads, kv_heads, capacity, d };
        let angles = self.rotation.angles()?;
        let out = match (s1, s2) {
            (CpuStorage::F32(qkv), CpuStorage::F32(pool)) => CpuStorage::F32(shape.attend(&qkv[o1..e1], &pool[o2..e2], width, &places, &angles)),
            (CpuStorage::BF16(qkv), CpuStorage::BF16(pool)) => CpuStorage::BF16(shape.attend(&qkv[o1..e1], &pool[o2..e2], width, &places, &angles)),
            (CpuStorage::F16(qkv), CpuStorage::F16(pool)) => CpuStorage::F16(shape.attend(&qkv[o1..e1], &pool[o2..e2], width, &places, &angles)),
            _ => candle_core::bail!("rows-attention: f32, bf16 or f16 operands of one dtype"),
        };
        Ok((out, Shape::from((rows, self.heads * d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout, s3: &candle_core::CudaStorage, l3: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::rows_attention(self, s1, l1, s2, l2, s3, l3)
    }
}

/// What the CPU twins of `write_kv` and `rows_attention` know of the rows and the pool: query heads, key/value heads,
/// positions a slot holds, head dimension.
struct PoolShape {
    heads: usize,
    kv_heads: usize,
    capacity: usize,
    d: usize,
}

impl PoolShape {
    /// Every row's keys and values into its slot at its position, the keys rotated on the way when `angles` are given.
    fn write<T: WithDType>(&self, pool: &mut [T], qkv: &[T], width: usize, places: &[(usize, usize)], angles: Option<&Angles>) {
        let d = self.d;
        let mut rotated = vec![0f32; d];
        for (i, (row, &(slot, position))) in qkv.chunks_exact(width).zip(places).enumerate() {
            for plane_head in 0..2 * self.kv_heads {
                let at = ((slot * 2 * self.kv_heads + plane_head) * self.capacity + position) * d;
                let (dst, src) = (&mut pool[at..at + d], &row[(self.heads + plane_head) * d..][..d]);
                match angles {
                    Some(angles) if plane_head < self.kv_heads => {
                        angles.rotate(i, src, &mut rotated);
                        dst.iter_mut().zip(&rotated).for_each(|(x, &r)| *x = T::from_f64(r as f64));
                    }
                    _ => dst.copy_from_slice(src),
                }
            }
        }
    }

    /// Each row's heads in turn, each query rotated with `angles` first, rows spread over the CPU's threads (a prompt's
    /// rows are many).
    fn attend<T: WithDType>(&self, qkv: &[T], pool: &[T], width: usize, places: &[(usize, usize)], angles: &Angles) -> Vec<T> {
        use rayon::prelude::*;
        let (d, group) = (self.d, self.heads / self.kv_heads);
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![T::zero(); places.len() * self.heads * d];
        out.par_chunks_mut(self.heads * d).zip(qkv.par_chunks(width)).zip(places).enumerate().for_each(|(i, ((out, row), &(slot, position)))| {
            let at = |plane: usize, head: usize, j: usize| &pool[(((slot * 2 + plane) * self.kv_heads + head) * self.capacity + j) * d..][..d];
            let (mut scores, mut q) = (vec![0f32; position + 1], vec![0f32; d]);
            for (h, (qh, out)) in row[..self.heads * d].chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
                angles.rotate(i, qh, &mut q);
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = q.iter().zip(at(0, h / group, j)).map(|(a, b)| a * b.to_f64() as f32).sum::<f32>() * scale;
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                scores.iter_mut().for_each(|s| *s = (*s - max).exp());
                let inv = 1.0 / scores.iter().sum::<f32>();
                for (i, o) in out.iter_mut().enumerate() {
                    *o = T::from_f64((scores.iter().enumerate().map(|(j, p)| p * at(1, h / group, j)[i].to_f64() as f32).sum::<f32>() * inv) as f64);
                }
            }
        });
        out
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{pool_dims, span, Fold, RotateQk, Rotation, RowsAttention, WriteKv};
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::backend::BackendStorage;
    use candle_core::{builder_arg, CudaStorage, DType, Layout, Result, Shape};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/frspec_kernels.ptx"));

    /// Launch `$kernel` for `$dtype` with its arguments pushed by `$push` (candle does not export its function type).
    macro_rules! launch {
        ($dev:expr, $kernel:expr, $dtype:expr, $config:expr, |$b:ident| { $($push:tt)* }) => {{
            let f = $dev.get_or_load_custom_func(&format!("{}_{}", $kernel, $dtype.as_str()), "frspec_kernels", PTX)?;
            let mut $b = f.builder();
            $($push)*
            // SAFETY: the arguments match the kernel's signature in kernels.cu; every index stays inside the views.
            unsafe { $b.launch($config) }.w()?;
        }};
    }

    /// `$typed::<T>(args)` for the storage's float dtype.
    macro_rules! by_dtype {
        ($dtype:expr, $op:literal, $typed:ident($($arg:expr),*)) => {
            match $dtype {
                DType::F32 => $typed::<f32>($($arg),*),
                DType::BF16 => $typed::<half::bf16>($($arg),*),
                DType::F16 => $typed::<half::f16>($($arg),*),
                other => candle_core::bail!("{}: no kernel for {other:?}", $op),
            }
        };
    }

    /// Threads of a `rows_attention` block (one block per row and query head): few enough that eight blocks share a
    /// multiprocessor when a forward has many rows, enough that one decode row's block reads its keys and values in
    /// one or two rounds of loads.
    const ATTENTION_THREADS: usize = 256;

    fn grid(blocks: usize, threads: usize, shared: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: shared as u32 }
    }

    /// A rotation's tables as read-locked storage, to be viewed on the device by `views` while the guards live.
    struct Tables<'a> {
        cos: (candle_core::StorageRef<'a>, &'a Layout),
        sin: (candle_core::StorageRef<'a>, &'a Layout),
    }

    impl<'a> Tables<'a> {
        fn of(r: &'a Rotation) -> Tables<'a> {
            Tables { cos: r.cos.storage_and_layout(), sin: r.sin.storage_and_layout() }
        }

        fn views(&self, op: &str) -> Result<(CudaView<'_, f32>, CudaView<'_, f32>)> {
            fn view<'s>((s, l): &'s (candle_core::StorageRef<'_>, &Layout), op: &str) -> Result<CudaView<'s, f32>> {
                let candle_core::Storage::Cuda(c) = &**s else { candle_core::bail!("{op}: RoPE tables on another device") };
                let (o, e) = span(l, op)?;
                Ok(c.as_cuda_slice::<f32>()?.slice(o..e))
            }
            Ok((view(&self.cos, op)?, view(&self.sin, op)?))
        }
    }

    pub(super) fn rotate_qk(op: &RotateQk, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<()> {
        fn typed<T: CudaDType + DeviceRepr>(op: &RotateQk, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<()> {
            let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, "rotate-qk")?, span(l2, "rotate-qk")?, span(l3, "rotate-qk")?);
            let (n, width) = (l1.dims()[0], l1.dims()[1]);
            let (dev, dtype) = (s1.device.clone(), s1.dtype());
            let (cos, sin) = (s2.as_cuda_slice::<f32>()?.slice(o2..e2), s3.as_cuda_slice::<f32>()?.slice(o3..e3));
            let mut x = s1.as_cuda_slice_mut::<T>()?.slice_mut(o1..e1);
            launch!(dev, "rope_qk", dtype, grid(n * op.heads, (op.head_dim / 2).clamp(32, 1024), 0), |b| {
                b.arg(&mut x);
                b.arg(&cos);
                b.arg(&sin);
                builder_arg!(b, op.heads as i32, op.head_dim as i32, width as i32, op.interleaved as i32);
            });
            Ok(())
        }
        by_dtype!(s1.dtype(), "rotate-qk", typed(op, s1, l1, s2, l2, s3, l3))
    }

    pub(super) fn silu_mul(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn typed<T: CudaDType + DeviceRepr>(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
            let (o, e) = span(l, "silu-mul")?;
            let (n, width) = (l.dims()[0], l.dims()[1] / 2);
            let dev = &s.device;
            let x = s.as_cuda_slice::<T>()?.slice(o..e);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n * width)? };
            launch!(dev, "silu_mul", s.dtype(), grid((n * width).div_ceil(256), 256, 0), |b| {
                b.arg(&x);
                b.arg(&out);
                builder_arg!(b, n, width);
            });
            Ok(T::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(s.dtype(), "silu-mul", typed(s, l))?;
        Ok((out, Shape::from((l.dims()[0], l.dims()[1] / 2))))
    }

    /// Values of a row one block of `argmax_chunks` reads (16 a thread).
    const ARGMAX_CHUNK: usize = 4096;

    pub(super) fn argmax_rows(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn typed<T: CudaDType + DeviceRepr>(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
            let (rows, cols, stride, o) = super::strided_rows(l)?;
            let chunks = cols.div_ceil(ARGMAX_CHUNK);
            let dev = &s.device;
            let x = s.as_cuda_slice::<T>()?.slice(o..o + (rows - 1) * stride + cols);
            // SAFETY: the first launch writes every (row, chunk) entry, the second every row.
            let (best, at, out) = unsafe { (dev.alloc::<f32>(rows * chunks)?, dev.alloc::<u32>(rows * chunks)?, dev.alloc::<u32>(rows)?) };
            let by_chunk = LaunchConfig { grid_dim: (chunks as u32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            launch!(dev, "argmax_chunks", s.dtype(), by_chunk, |b| {
                b.arg(&x);
                b.arg(&best);
                b.arg(&at);
                builder_arg!(b, cols as i32, stride as i64, ARGMAX_CHUNK as i32);
            });
            launch!(dev, "argmax_pick", DType::U32, grid(rows, 256, 0), |b| {
                b.arg(&best);
                b.arg(&at);
                b.arg(&out);
                builder_arg!(b, chunks as i32);
            });
            Ok(u32::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(s.dtype(), "argmax-rows", typed(s, l))?;
        Ok((out, Shape::from(l.dims()[0])))
    }

    pub(super) fn matvec(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        fn typed<T: CudaDType + DeviceRepr>(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<CudaStorage> {
            let ((o1, e1), (o2, e2)) = (span(l1, "matvec")?, span(l2, "matvec")?);
            let (n, k) = (l1.dims()[0], l1.dims()[1]);
            let dev = &s1.device;
            let (w, x) = (s1.as_cuda_slice::<T>()?.slice(o1..e1), s2.as_cuda_slice::<T>()?.slice(o2..e2));
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n)? };
            // A warp per row, 8 rows a block.
            launch!(dev, "matvec", s1.dtype(), grid(n.div_ceil(8), 256, 0), |b| {
                b.arg(&w);
                b.arg(&x);
                b.arg(&out);
                builder_arg!(b, n as i32, k as i32);
            });
            Ok(T::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(s1.dtype(), "matvec", typed(s1, l1, s2, l2))?;
        Ok((out, Shape::from((1, l1.dims()[0]))))
    }

    pub(super) fn matvec_with(fold: Fold, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<(CudaStorage, Shape)> {
        fn typed<T: CudaDType + DeviceRepr>(fold: Fold, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<CudaStorage> {
            let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, "matvec")?, span(l2, "matvec")?, span(l3, "matvec")?);
            let (n, k) = (fold.outputs(l1.dims()[0]), l1.dims()[1]);
            let dev = &s1.device;
            let (w, x, z) = (s1.as_cuda_slice::<T>()?.slice(o1..e1), s2.as_cuda_slice::<T>()?.slice(o2..e2), s3.as_cuda_slice::<T>()?.slice(o3..e3));
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n)? };
            match fold {
                Fold::Norm(eps) | Fold::NormSwiglu(eps) => {
                    let kernel = if matches!(fold, Fold::Norm(_)) { "norm_matvec" } else { "norm_swiglu_matvec" };
                    launch!(dev, kernel, s1.dtype(), grid(n.div_ceil(8), 256, 0), |b| {
                        b.arg(&w);
                        b.arg(&x);
                        b.arg(&z);
                        b.arg(&out);
                        builder_arg!(b, n as i32, k as i32, eps);
                    })
                }
                Fold::Residual => launch!(dev, "matvec_add", s1.dtype(), grid(n.div_ceil(8), 256, 0), |b| {
                    b.arg(&w);
                    b.arg(&x);
                    b.arg(&z);
                    b.arg(&out);
                    builder_arg!(b, n as i32, k as i32);
                }),
            }
            Ok(T::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(s1.dtype(), "matvec", typed(fold, s1, l1, s2, l2, s3, l3))?;
        Ok((out, Shape::from((1, fold.outputs(l1.dims()[0])))))
    }

    pub(super) fn write_kv(op: &WriteKv, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<()> {
        fn typed<T: CudaDType + DeviceRepr>(op: &WriteKv, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<()> {
            let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, "write-kv")?, span(l2, "write-kv")?, span(l3, "write-kv")?);
            let (kv_heads, capacity, d) = pool_dims(l1)?;
            let (rows, width) = (l2.dims()[0], l2.dims()[1]);
            let (dev, dtype) = (s1.device.clone(), s1.dtype());
            let (qkv, at) = (s2.as_cuda_slice::<T>()?.slice(o2..e2), s3.as_cuda_slice::<u32>()?.slice(o3..e3));
            let mut pool = s1.as_cuda_slice_mut::<T>()?.slice_mut(o1..e1);
            let tables = op.rotation.as_ref().map(Tables::of);
            let views = tables.as_ref().map(|t| t.views("write-kv")).transpose()?;
            // Null tables: the rows are copied as they are.
            let null = 0u64;
            // A block per (row, key or value head), a thread per element of the head.
            launch!(dev, "write_kv", dtype, grid(rows * 2 * kv_heads, d.next_multiple_of(32).min(1024), 0), |b| {
                b.arg(&qkv);
                b.arg(&mut pool);
                b.arg(&at);
                match &views {
                    Some((cos, sin)) => {
                        b.arg(cos);
                        b.arg(sin);
                    }
                    None => {
                        b.arg(&null);
                        b.arg(&null);
                    }
                }
                let interleaved = op.rotation.as_ref().is_some_and(|r| r.interleaved) as i32;
                builder_arg!(b, interleaved, op.heads as i32, kv_heads as i32, d as i32, capacity as i32, width as i32);
            });
            Ok(())
        }
        by_dtype!(s1.dtype(), "write-kv", typed(op, s1, l1, s2, l2, s3, l3))
    }

    pub(super) fn rows_attention(op: &RowsAttention, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<(CudaStorage, Shape)> {
        fn typed<T: CudaDType + DeviceRepr>(op: &RowsAttention, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, s3: &CudaStorage, l3: &Layout) -> Result<CudaStorage> {
            let ((o1, e1), (o2, e2), (o3, e3)) = (span(l1, "rows-attention")?, span(l2, "rows-attention")?, span(l3, "rows-attention")?);
            let (kv_heads, capacity, d) = pool_dims(l2)?;
            let (rows, width) = (l1.dims()[0], l1.dims()[1]);
            let dev = &s1.device;
            let (qkv, pool, at) = (s1.as_cuda_slice::<T>()?.slice(o1..e1), s2.as_cuda_slice::<T>()?.slice(o2..e2), s3.as_cuda_slice::<u32>()?.slice(o3..e3));
            let tables = Tables::of(&op.rotation);
            let (cos, sin) = tables.views("rows-attention")?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(rows * op.heads * d)? };
            let scale = 1.0f32 / (d as f32).sqrt();
            // Shared memory holds the longest row's scores, the query row and a partial row per group of threads that
            // reads a whole value row in 16-byte vectors.
            let groups = ATTENTION_THREADS / (d * s1.dtype().size_in_bytes() / 16);
            launch!(dev, "rows_attention", s1.dtype(), grid(rows * op.heads, ATTENTION_THREADS, 4 * (op.longest + d + groups * d)), |b| {
                b.arg(&qkv);
                b.arg(&pool);
                b.arg(&at);
                b.arg(&cos);
                b.arg(&sin);
                builder_arg!(b, op.rotation.interleaved as i32);
                b.arg(&out);
                builder_arg!(b, op.heads as i32, kv_heads as i32, d as i32, capacity as i32, width as i32, op.longest as i32, scale);
            });
            Ok(T::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(s1.dtype(), "rows-attention", typed(op, s1, l1, s2, l2, s3, l3))?;
        Ok((out, Shape::from((l1.dims()[0], op.heads * pool_dims(l2)?.2))))
    }
}
