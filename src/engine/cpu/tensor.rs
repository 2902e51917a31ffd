//! Weight matrices and the CPU kernels that multiply them.
//!
//! Why hand-written rather than candle's CPU ops: speculative verification forwards a block of k+1 tokens and
//! must reproduce, bit for bit, what k+1 one-token forwards compute (greedy losslessness is tested exactly).
//! candle's gemm and quantized paths pick different summation orders for one row and for many (measured in
//! ../shared/reference/CRATES.md: up to 0.53 in a logit), quantize activations to 8 bits, and have no SIMD dot
//! product for Q4_1. Here every output element is one `dot` of one weight row with one activation row, always
//! in the same order, whatever the batch size or thread count; activations stay f32, so results follow an f32
//! reference that dequantizes the weights. The exception is K-quant rows, which by default meet activations
//! quantized to 8 bits as llama.cpp does, and every quantized row with `Activations::Q8` (`q8`): still per activation
//! row, so a block still equals its rows, and the integer sums are exact.

use super::kquants::{self, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, SuperBlock, QK_K, SUBS};
use super::q8::{self, Q8Rows, Q8View};
use half::f16;
use rayon::prelude::*;

/// Row storage of a `[rows, cols]` weight matrix. Quantized rows stay in their GGUF block layout.
#[derive(Clone)]
pub enum Storage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    /// Q4_1 and Q8_0 rows regrouped for the AVX-512 VNNI kernel (`Storage::q4_1`, `Storage::q8_0`).
    Q4_1Interleaved(q8::Interleaved<BlockQ4_1>),
    Q8_0Interleaved(q8::Interleaved<BlockQ8_0>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
}

pub const QK: usize = 32;

impl Storage {
    /// Q8_0 rows of `cols` columns in the layout this process's products read fastest (`interleaved`).
    pub fn q8_0(blocks: Vec<BlockQ8_0>, cols: usize) -> Storage {
        interleaved(blocks, cols).map_or_else(Storage::Q8_0, Storage::Q8_0Interleaved)
    }

    /// Q4_1 rows the same way.
    pub fn q4_1(blocks: Vec<BlockQ4_1>, cols: usize) -> Storage {
        interleaved(blocks, cols).map_or_else(Storage::Q4_1, Storage::Q4_1Interleaved)
    }
}

/// Rows of `cols` columns as `q8::Interleaved` where the AVX-512 VNNI kernel will meet 8-bit activations, else the
/// GGUF layout as read (also for rows that are not whole blocks, which the loader rejects).
fn interleaved<B: q8::Interleave>(blocks: Vec<B>, cols: usize) -> Result<q8::Interleaved<B>, Vec<B>> {
    #[cfg(target_arch = "x86_64")]
    if cols >= QK && cols.is_multiple_of(QK) && Kernel::detect() == Kernel::Avx512 && has_vnni() && Activations::expected() == Activations::Q8 {
        return Ok(q8::Interleaved::new(&blocks, cols / QK));
    }
    Err(blocks)
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// A block of 32 weights in its GGUF layout, and the f32 values it stands for: the one definition of a weight
/// that every kernel multiplies by (the vector kernels compute the same values with the same operations).
pub trait Block: Copy + Send + Sync {
    fn values(&self) -> [f32; QK];
}

/// Value l of a 4-bit block: elements 0..16 are the low nibbles, 16..32 the high ones.
pub(super) fn nibble(qs: &[u8; QK / 2], l: usize) -> u8 {
    if l < QK / 2 {
        qs[l] & 0x0f
    } else {
        qs[l - QK / 2] >> 4
    }
}

impl Block for BlockQ4_0 {
    fn values(&self) -> [f32; QK] {
        let d = self.d.to_f32();
        std::array::from_fn(|l| d * (nibble(&self.qs, l) as f32 - 8.0))
    }
}

impl Block for BlockQ4_1 {
    /// `d · q + m` in one rounding (a fused multiply-add), as the vector kernels compute it.
    fn values(&self) -> [f32; QK] {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        std::array::from_fn(|l| d.mul_add(nibble(&self.qs, l) as f32, m))
    }
}

impl Block for BlockQ8_0 {
    fn values(&self) -> [f32; QK] {
        let d = self.d.to_f32();
        self.qs.map(|q| d * q as f32)
    }
}

fn blocks_into<B: Block>(blocks: impl IntoIterator<Item = B>, out: &mut [f32]) {
    for (b, o) in blocks.into_iter().zip(out.chunks_exact_mut(QK)) {
        o.copy_from_slice(&b.values());
    }
}

/// A `[rows, cols]` matrix; `y = W x` for each activation row x.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

impl Matrix {
    pub fn dtype_name(&self) -> &'static str {
        match self.storage {
            Storage::F32(_) => "f32",
            Storage::F16(_) => "f16",
            Storage::Q4_0(_) => "q4_0",
            Storage::Q4_1(_) | Storage::Q4_1Interleaved(_) => "q4_1",
            Storage::Q8_0(_) | Storage::Q8_0Interleaved(_) => "q8_0",
            Storage::Q4K(_) => "q4_k",
            Storage::Q5K(_) => "q5_k",
            Storage::Q6K(_) => "q6_k",
        }
    }

    /// Bytes the matrix occupies (what one full pass reads from memory).
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::F16(v) => v.len() * 2,
            Storage::Q4_0(v) => v.len() * std::mem::size_of::<BlockQ4_0>(),
            Storage::Q4_1(v) => v.len() * std::mem::size_of::<BlockQ4_1>(),
            Storage::Q8_0(v) => v.len() * std::mem::size_of::<BlockQ8_0>(),
            Storage::Q4_1Interleaved(v) => v.bytes(),
            Storage::Q8_0Interleaved(v) => v.bytes(),
            Storage::Q4K(v) => v.len() * std::mem::size_of::<BlockQ4K>(),
            Storage::Q5K(v) => v.len() * std::mem::size_of::<BlockQ5K>(),
            Storage::Q6K(v) => v.len() * std::mem::size_of::<BlockQ6K>(),
        }
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    /// Super-blocks of 256 per row (K-quants).
    fn superblocks_per_row(&self) -> usize {
        self.cols / QK_K
    }

    /// Row `r` dequantized into `out` (embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (c, nb, nk) = (self.cols, self.blocks_per_row(), self.superblocks_per_row());
        match &self.storage {
            Storage::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
            Storage::F16(v) => out.iter_mut().zip(&v[r * c..(r + 1) * c]).for_each(|(o, w)| *o = w.to_f32()),
            Storage::Q4_0(v) => blocks_into(v[r * nb..(r + 1) * nb].iter().copied(), out),
            Storage::Q4_1(v) => blocks_into(v[r * nb..(r + 1) * nb].iter().copied(), out),
            Storage::Q8_0(v) => blocks_into(v[r * nb..(r + 1) * nb].iter().copied(), out),
            Storage::Q4_1Interleaved(v) => blocks_into((0..nb).map(|b| v.block(r, b)), out),
            Storage::Q8_0Interleaved(v) => blocks_into((0..nb).map(|b| v.block(r, b)), out),
            Storage::Q4K(v) => kquants::dequantize(&v[r * nk..(r + 1) * nk], out),
            Storage::Q5K(v) => kquants::dequantize(&v[r * nk..(r + 1) * nk], out),
            Storage::Q6K(v) => kquants::dequantize(&v[r * nk..(r + 1) * nk], out),
        }
    }

    /// The matrix made of the given rows, in that order, in the same storage (FR-Spec's sliced LM head).
    pub fn select_rows(&self, ids: &[u32]) -> Matrix {
        fn gather<T: Copy>(v: &[T], per_row: usize, ids: &[u32]) -> Vec<T> {
            ids.iter().flat_map(|&r| &v[r as usize * per_row..(r as usize + 1) * per_row]).copied().collect()
        }
        let (c, nb, nk) = (self.cols, self.blocks_per_row(), self.superblocks_per_row());
        let storage = match &self.storage {
            Storage::F32(v) => Storage::F32(gather(v, c, ids)),
            Storage::F16(v) => Storage::F16(gather(v, c, ids)),
            Storage::Q4_0(v) => Storage::Q4_0(gather(v, nb, ids)),
            Storage::Q4_1(v) => Storage::Q4_1(gather(v, nb, ids)),
            Storage::Q8_0(v) => Storage::Q8_0(gather(v, nb, ids)),
            Storage::Q4_1Interleaved(v) => Storage::Q4_1Interleaved(v.select_rows(ids)),
            Storage::Q8_0Interleaved(v) => Storage::Q8_0Interleaved(v.select_rows(ids)),
            Storage::Q4K(v) => Storage::Q4K(gather(v, nk, ids)),
            Storage::Q5K(v) => Storage::Q5K(gather(v, nk, ids)),
            Storage::Q6K(v) => Storage::Q6K(gather(v, nk, ids)),
        };
        Matrix { rows: ids.len(), cols: self.cols, storage }
    }

    /// `out[b, r] = dot(W[r], x[b])` for `n = x.len() / cols` activation rows. Each weight row is unpacked once
    /// for up to `GROUP` activation rows at a time; each output still follows the exact operation sequence of a
    /// one-row product, so a block equals its rows done one by one, bit for bit.
    /// `scratch` holds the quantized activations (K-quants) and the tasks' results; it is reused between calls.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        Matrix::matmul_many(x, &mut [(self, out)], scratch)
    }

    /// Several products of the same activations (a layer's q, k and v; gate and up), each as `matmul` computes it,
    /// in one parallel region: the pool's threads are woken once, not once a matrix (waking a sleeping thread cost
    /// a tenth of decode on a 2-core virtual machine). All matrices have `x`'s row width.
    pub fn matmul_many(x: &[f32], products: &mut [(&Matrix, &mut [f32])], scratch: &mut MatmulScratch) {
        Matrix::matmul_many_with(Kernel::detect(), Activations::get(), x, products, scratch)
    }

    fn is_k_quant(&self) -> bool {
        matches!(self.storage, Storage::Q4K(_) | Storage::Q5K(_) | Storage::Q6K(_))
    }

    /// Rows of blocks of 32 (Q4_0, Q4_1, Q8_0, the last two in either layout).
    fn is_block_quant(&self) -> bool {
        matches!(self.storage, Storage::Q4_0(_) | Storage::Q4_1(_) | Storage::Q8_0(_) | Storage::Q4_1Interleaved(_) | Storage::Q8_0Interleaved(_))
    }

    #[cfg(test)]
    fn matmul_with(&self, kernel: Kernel, activations: Activations, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        Matrix::matmul_many_with(kernel, activations, x, &mut [(self, out)], scratch)
    }

    fn matmul_many_with(kernel: Kernel, activations: Activations, x: &[f32], products: &mut [(&Matrix, &mut [f32])], scratch: &mut MatmulScratch) {
        let cols = products[0].0.cols;
        let n = x.len() / cols;
        debug_assert_eq!(x.len(), n * cols);
        debug_assert!(products.iter().all(|(m, out)| m.cols == cols && out.len() == n * m.rows));
        // Each activation row is quantized on its own, so a row's products never depend on the others'.
        scratch.q8.clear();
        if activations != Activations::F32 && products.iter().any(|(m, _)| m.is_k_quant()) {
            quantize_q8k(kernel, x, &mut scratch.q8);
        }
        scratch.q8_32.clear();
        if activations == Activations::Q8 && products.iter().any(|(m, _)| m.is_block_quant()) {
            quantize_q8_32(kernel, x, &mut scratch.q8_32);
        }
        let (q8, q8_32) = (&scratch.q8, &scratch.q8_32);
        // The matrices' rows, stacked, are split into chunks, one task each. A task computes its rows laid out as
        // the outputs are ([n, rows], its own slice of `results`), and copies each activation row's run into them;
        // done after the parallel region, the copies kept one core busy while the other waited. Laid out [rows, n],
        // the kernels' stores and the copies' loads were a row apart (5% of a batched sweep in that transpose alone).
        // A chunk may cover the end of one matrix and the start of the next.
        let rows: usize = products.iter().map(|(m, _)| m.rows).sum();
        let rows_per_task = (rows / (4 * pool().current_num_threads())).clamp(16, 1024);
        let t = &mut scratch.results;
        t.resize(rows * n, 0.0);
        let outs = &mut scratch.outputs;
        outs.clear();
        outs.extend(products.iter_mut().map(|(_, out)| Output(out.as_mut_ptr())));
        let matrices = || products.iter().zip(outs.iter()).scan(0, |start, ((m, _), out)| {
            *start += m.rows;
            Some((*start - m.rows, &**m, *out))
        });
        let task = |(task, chunk): (usize, &mut [f32])| {
            let first = task * rows_per_task;
            let task_rows = chunk.len() / n;
            for (start, m, out) in matrices() {
                let (from, to) = (first.max(start), (first + task_rows).min(start + m.rows));
                if from < to {
                    m.rows_into(kernel, from - start..to - start, x, q8, q8_32, &mut chunk[from - first..], task_rows);
                    for b in 0..n {
                        let run = &chunk[b * task_rows + from - first..][..to - from];
                        // SAFETY: `out` is this product's output, [n, m.rows], borrowed mutably by `products` for the
                        // whole call and touched by nothing else until the tasks end; elements (b, from − start ..
                        // to − start) are written only by the task whose rows they are.
                        unsafe { std::ptr::copy_nonoverlapping(run.as_ptr(), out.0.add(b * m.rows + from - start), run.len()) };
                    }
                }
            }
        };
        // Waking the thread pool costs more than a small product (EAGLE heads, test models): stay on this thread.
        if rows * cols * n < PARALLEL_MIN_MACS {
            t.chunks_mut(rows_per_task * n).enumerate().for_each(task);
        } else {
            pool().install(|| t.par_chunks_mut(rows_per_task * n).enumerate().for_each(task));
        }
        outs.clear();
    }

    /// Weight rows `rows` times every activation row: row r's product with activation row b goes to
    /// `out[b · stride + r − rows.start]`. A tile of weight rows meets one group of activation rows at a time: the
    /// group stays in L1 and the tile in L2 however many rows the batch has (all rows against every weight row
    /// overflow L1 past about 20 rows of 576 and ran a batch of verification blocks 1.5× slower than the blocks one
    /// by one).
    #[allow(clippy::too_many_arguments)]
    fn rows_into(&self, kernel: Kernel, rows: std::ops::Range<usize>, x: &[f32], q8: &[BlockQ8K], q8_32: &Q8Rows, out: &mut [f32], stride: usize) {
        let n = x.len() / self.cols;
        let (nb, nk) = (self.blocks_per_row(), self.superblocks_per_row());
        let integer_blocks = !q8_32.is_empty() && self.is_block_quant();
        let group = if integer_blocks { Q8_GROUP } else { GROUP };
        for tile in rows.clone().step_by(ROW_TILE) {
            let end = (tile + ROW_TILE).min(rows.end);
            let mut b = 0;
            while b < n {
                let g = (n - b).min(group);
                let xs = &x[b * self.cols..(b + g) * self.cols];
                let qs = if q8.is_empty() || !self.is_k_quant() { &q8[..0] } else { &q8[b * nk..(b + g) * nk] };
                let q32 = integer_blocks.then(|| q8_32.rows(b..b + g, nb));
                let cold = b == 0;
                self.tile_dots(kernel, tile..end, xs, qs, q32, cold, &mut out[b * stride + tile - rows.start..], stride, g);
                b += g;
            }
        }
    }

    /// Dots of the weight rows `rows` with each of the `g` (≤ GROUP) activation rows in `x` (in `q8` instead, as
    /// Q8_K blocks, when K-quant rows take integer products; in `q32` when blocks of 32 do): row r's product with
    /// activation row j goes to `out[j · stride + r − rows.start]`. `cold`: the tile's first group, which reads
    /// the weights from memory.
    #[allow(clippy::too_many_arguments)]
    fn tile_dots(&self, kernel: Kernel, rows: std::ops::Range<usize>, x: &[f32], q8: &[BlockQ8K], q32: Option<Q8View>, cold: bool, out: &mut [f32], stride: usize, g: usize) {
        let (nb, nk) = (self.blocks_per_row(), self.superblocks_per_row());
        // Integer products take a whole tile per call, with the group size as a constant: K-quant rows are short (3
        // super-blocks at d = 768) and a call per row cost a fifth of decode; blocks of 32 go 16 rows a vector.
        macro_rules! by_group {
            ($n:ident => $call:expr) => {
                match g {
                    1 => { const $n: usize = 1; $call }
                    2 => { const $n: usize = 2; $call }
                    3 => { const $n: usize = 3; $call }
                    4 => { const $n: usize = 4; $call }
                    5 => { const $n: usize = 5; $call }
                    6 => { const $n: usize = 6; $call }
                    7 => { const $n: usize = 7; $call }
                    8 => { const $n: usize = 8; $call }
                    9 => { const $n: usize = 9; $call }
                    10 => { const $n: usize = 10; $call }
                    11 => { const $n: usize = 11; $call }
                    12 => { const $n: usize = 12; $call }
                    13 => { const $n: usize = 13; $call }
                    14 => { const $n: usize = 14; $call }
                    15 => { const $n: usize = 15; $call }
                    _ => { const $n: usize = 16; $call }
                }
            };
        }
        let tile = |per_row: usize| rows.start * per_row..rows.end * per_row;
        match (&self.storage, q32) {
            (Storage::Q4_0(v), Some(a)) => by_group!(N => dots_q8_rows::<N, _>(kernel, &v[tile(nb)], nb, &a, cold, out, stride)),
            (Storage::Q4_1(v), Some(a)) => by_group!(N => dots_q8_rows::<N, _>(kernel, &v[tile(nb)], nb, &a, cold, out, stride)),
            (Storage::Q8_0(v), Some(a)) => by_group!(N => dots_q8_rows::<N, _>(kernel, &v[tile(nb)], nb, &a, cold, out, stride)),
            #[cfg(target_arch = "x86_64")]
            // SAFETY (both): Kernel::Avx512 means avx512f/bw/vl, avx2, fma and f16c, and has_vnni() checked avx512vnni.
            (Storage::Q4_1Interleaved(v), Some(a)) if kernel == Kernel::Avx512 && has_vnni() => by_group!(N => unsafe { interleaved_dots::<N, _>(v, rows, &a, cold, out, stride) }),
            #[cfg(target_arch = "x86_64")]
            (Storage::Q8_0Interleaved(v), Some(a)) if kernel == Kernel::Avx512 && has_vnni() => by_group!(N => unsafe { interleaved_dots::<N, _>(v, rows, &a, cold, out, stride) }),
            // Another kernel or activations than the layout was made for (tests compare them all; a mode set after
            // loading): the tile's rows in the GGUF layout again.
            (Storage::Q4_1Interleaved(v), _) => {
                let tile = Matrix { rows: rows.len(), cols: self.cols, storage: Storage::Q4_1(v.blocks(rows.clone())) };
                tile.tile_dots(kernel, 0..rows.len(), x, q8, q32, cold, out, stride, g)
            }
            (Storage::Q8_0Interleaved(v), _) => {
                let tile = Matrix { rows: rows.len(), cols: self.cols, storage: Storage::Q8_0(v.blocks(rows.clone())) };
                tile.tile_dots(kernel, 0..rows.len(), x, q8, q32, cold, out, stride, g)
            }
            (Storage::Q4K(v), _) if !q8.is_empty() => by_group!(N => dots_k8_rows::<N, _>(kernel, &v[tile(nk)], nk, q8, out, stride)),
            (Storage::Q5K(v), _) if !q8.is_empty() => by_group!(N => dots_k8_rows::<N, _>(kernel, &v[tile(nk)], nk, q8, out, stride)),
            (Storage::Q6K(v), _) if !q8.is_empty() => by_group!(N => dots_k8_rows::<N, _>(kernel, &v[tile(nk)], nk, q8, out, stride)),
            _ => {
                let mut dots = [0f32; GROUP];
                for r in rows.clone() {
                    self.row_dots(kernel, r, x, &mut dots[..g]);
                    for (j, v) in dots[..g].iter().enumerate() {
                        out[j * stride + r - rows.start] = *v;
                    }
                }
            }
        }
    }

    /// Dots of row `r` with each of the `out.len()` (≤ GROUP) f32 activation rows in `x`.
    #[inline]
    fn row_dots(&self, kernel: Kernel, r: usize, x: &[f32], out: &mut [f32]) {
        let (c, nb, nk) = (self.cols, self.blocks_per_row(), self.superblocks_per_row());
        macro_rules! group {
            ($f:ident, $($arg:expr),*) => {
                match out.len() {
                    1 => out.copy_from_slice(&$f::<1>(kernel, $($arg),*)),
                    2 => out.copy_from_slice(&$f::<2>(kernel, $($arg),*)),
                    3 => out.copy_from_slice(&$f::<3>(kernel, $($arg),*)),
                    4 => out.copy_from_slice(&$f::<4>(kernel, $($arg),*)),
                    5 => out.copy_from_slice(&$f::<5>(kernel, $($arg),*)),
                    6 => out.copy_from_slice(&$f::<6>(kernel, $($arg),*)),
                    7 => out.copy_from_slice(&$f::<7>(kernel, $($arg),*)),
                    _ => out.copy_from_slice(&$f::<8>(kernel, $($arg),*)),
                }
            };
        }
        match &self.storage {
            Storage::F32(v) => group!(dots_f32, &v[r * c..(r + 1) * c], x),
            Storage::F16(v) => group!(dots_f16, &v[r * c..(r + 1) * c], x),
            Storage::Q4_0(v) => group!(dots_blocks, &v[r * nb..(r + 1) * nb], x),
            Storage::Q4_1(v) => group!(dots_blocks, &v[r * nb..(r + 1) * nb], x),
            Storage::Q8_0(v) => group!(dots_blocks, &v[r * nb..(r + 1) * nb], x),
            Storage::Q4_1Interleaved(_) | Storage::Q8_0Interleaved(_) => unreachable!("tile_dots reads interleaved rows back in the GGUF layout"),
            Storage::Q4K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk], x),
            Storage::Q5K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk], x),
            Storage::Q6K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk], x),
        }
    }
}

/// Interleaved rows `rows` of `w` times N activation rows (`a`) on the AVX-512 VNNI kernel: row r's product with
/// activation row j goes to `out[j · stride + r − rows.start]`.
///
/// # Safety
/// On a CPU with avx512f, avx512bw, avx512vl, avx512vnni, avx2, fma and f16c (`Kernel::Avx512` and `has_vnni()`).
#[cfg(target_arch = "x86_64")]
unsafe fn interleaved_dots<const N: usize, B: q8::Interleave + q8::VectorBlock>(w: &q8::Interleaved<B>, rows: std::ops::Range<usize>, a: &Q8View, cold: bool, out: &mut [f32], stride: usize) {
    // The kernel reads N activation rows of the weights' blocks a row: checked against the weights, not `a`.
    let nb = w.row_blocks();
    assert!(rows.end <= w.rows() && (N - 1) * stride + rows.len() <= out.len() && a.qs.len() >= N * nb * QK && a.d.len() >= N * nb && a.sums.len() >= N * nb);
    // SAFETY: the CPU features are the caller's promise; the bounds are checked above.
    unsafe { q8::avx512::dots_interleaved::<N, B>(w, rows, a, cold, out, stride) }
}

/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// How many activation rows share one unpacking of a weight row (bounded by the 16 vector registers).
const GROUP: usize = 8;

/// The same for the integer products of blocks of 32, which hold an activation row's sums in one register (16 rows
/// a vector): each group gathers the weights again, and 40 rows in groups of 8 cost 8 times what 5 rows cost.
const Q8_GROUP: usize = 16;

/// Weight rows a task takes through every activation group before moving on (64 f32 rows of 576 are 144 KiB).
const ROW_TILE: usize = 64;

/// The thread pool every product runs on (RAYON_NUM_THREADS threads, default one per core). Callers run whole
/// forward passes inside it (`pool().install`), so each parallel product is a work-stealing join between pool
/// threads rather than a sleep and wake-up of the calling thread (which cost a third of decode time).
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("frspec-{i}")).build().expect("thread pool"))
}

/// How long a spinner of `with_pool_awake` polls without finding work before it ends: far longer than the gaps between
/// two products of a forward pass (tens of microseconds), and the longest a thread that picked the spinner up inside
/// the forward's own work can hold that work back.
const SPIN_IDLE_LIMIT: std::time::Duration = std::time::Duration::from_micros(500);

/// Runs `f` on the pool (as `pool().install`) with the pool's other threads kept awake until it returns: each polls
/// for work (`rayon::yield_now`) instead of going to sleep between two products. On a virtual machine a sleeping thread
/// halts its virtual CPU, and a decode step wakes it for each of its ~120 parallel regions: one thread ran as fast as
/// llama.cpp's one thread, two ran slower than llama.cpp's two until they were kept awake
/// (`results/bench/kquants-2026-12-01.md`). The waiting threads yield to any other runnable thread, and hold their
/// cores only while a forward pass runs.
///
/// A spinner is a rayon job, and rayon may start a job on a thread that is itself waiting inside `f`'s work (a join
/// whose other half was stolen): that thread cannot return to `f` until the spinner ends. So a spinner also ends once
/// it has found no work for `SPIN_IDLE_LIMIT`; a spinner that waited for `done` alone deadlocked such a thread and with
/// it the forward (`tests/pool_awake.rs`, 32 threads, at once; a copy of it with 16 threads within ten thousand
/// calls).
pub fn with_pool_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Sets the flag however `f` ends, so that a panic in `f` cannot leave the spinners spinning.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    fn spin(done: &AtomicBool, others: usize) {
        if others == 0 {
            return;
        }
        // One spinner here and the rest handed on: `join` lets an idle thread take the second half.
        rayon::join(
            || {
                let mut last_work = std::time::Instant::now();
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        last_work = std::time::Instant::now();
                    } else if last_work.elapsed() > SPIN_IDLE_LIMIT {
                        return;
                    } else {
                        // Idle: give the core to any other runnable thread (tests run side by side, a user's other
                        // work); with none, the call returns at once and the virtual CPU stays up.
                        std::thread::yield_now();
                    }
                }
            },
            || spin(done, others - 1),
        );
    }
    let done = AtomicBool::new(false);
    let others = pool().current_num_threads() - 1;
    pool().install(|| {
        rayon::join(
            || {
                let _done = Done(&done);
                f()
            },
            || spin(&done, others),
        )
        .0
    })
}

/// Buffers `Matrix::matmul` reuses so the decode loop does not allocate per token.
#[derive(Default)]
pub struct MatmulScratch {
    q8: Vec<BlockQ8K>,
    q8_32: Q8Rows,
    /// Each task's products row-major ([rows, n]), before they go, transposed, to the outputs.
    results: Vec<f32>,
    /// Each product's output, while the tasks write into it (empty between calls).
    outputs: Vec<Output>,
}

/// Where a product's output starts, shared by the tasks that write disjoint elements of it (`matmul_many_with`).
#[derive(Clone, Copy)]
struct Output(*mut f32);

// SAFETY: an `Output` is only written through during `matmul_many_with`, while the slice it points into is borrowed
// mutably by the call, and each element by one task only.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

/// Which quantized rows meet activations quantized to 8 bits (integer products, as llama.cpp computes them), chosen
/// once per process: `FRSPEC_ACTIVATIONS=f32|kquants|q8`, or `sweep --activations` (which records it).
/// - `Q8` (the default): every quantized row. Q4_0, Q4_1 and Q8_0 rows take activations in blocks of 32 (`q8`),
///   K-quant rows Q8_K activations: llama.cpp's arithmetic for each, ≈ 2× the speed of f32 activations with AVX-512
///   VNNI or AVX2 (`results/bench/q8-activations-2026-12-02.md`, `results/bench/q8-default-2026-12-02.md`).
/// - `KQuants`: K-quant rows only, ≈ 4× the speed of f32 there, llama.cpp's speed and accuracy
///   (`results/bench/decode-vs-llamacpp-*.Q4_K_M.md`, `results/numerics/kquants.md`); every other row multiplies
///   exact f32 activations. The default until 2026-12-02: a sweep folder that does not name its activations used it.
/// - `F32`: every product with exact activations: logits follow an f32 reference of the dequantized weights to 1e-4
///   (what the candle engine computes, so its records compare with these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    F32,
    #[value(name = "kquants")]
    KQuants,
    Q8,
}

static ACTIVATIONS: std::sync::OnceLock<Activations> = std::sync::OnceLock::new();

impl Activations {
    /// The process's mode: what `set` chose, else `FRSPEC_ACTIVATIONS`, else the default. Fixed at the first call.
    pub fn get() -> Activations {
        *ACTIVATIONS.get_or_init(Activations::from_env)
    }

    /// The mode products will run in, without fixing it (`Storage::q8_0` lays rows out for it at load).
    fn expected() -> Activations {
        ACTIVATIONS.get().copied().unwrap_or_else(Activations::from_env)
    }

    /// `FRSPEC_ACTIVATIONS`, or the default when it is not set (an unknown value is refused where the mode is
    /// chosen: `from_env_checked`).
    fn from_env() -> Activations {
        Activations::from_env_checked().unwrap_or(Activations::default_mode())
    }

    /// `FRSPEC_ACTIVATIONS` read, with one error for a value that names no mode.
    pub fn from_env_checked() -> anyhow::Result<Activations> {
        match std::env::var("FRSPEC_ACTIVATIONS") {
            Err(_) => Ok(Activations::default_mode()),
            Ok(v) => <Activations as clap::ValueEnum>::from_str(&v, true)
                .map_err(|_| anyhow::anyhow!("FRSPEC_ACTIVATIONS is `{v}`: expected f32, kquants or q8")),
        }
    }

    /// Makes `mode` the process's mode before any product runs; an error if a product already ran with another.
    pub fn set(mode: Activations) -> anyhow::Result<()> {
        let chosen = *ACTIVATIONS.get_or_init(|| mode);
        anyhow::ensure!(chosen == mode, "activations are already {} in this process, not {}", chosen.name(), mode.name());
        Ok(())
    }

    pub fn default_mode() -> Activations {
        Activations::Q8
    }

    /// The mode of sweep folders whose settings do not name one (made before the field existed): they leave it out.
    pub fn unnamed() -> Activations {
        Activations::KQuants
    }

    pub fn is_unnamed(&self) -> bool {
        *self == Activations::unnamed()
    }

    pub fn name(self) -> &'static str {
        match self {
            Activations::F32 => "f32",
            Activations::KQuants => "kquants",
            Activations::Q8 => "q8",
        }
    }
}

/// Which dot-product implementation this CPU runs. Chosen once per process, so results never mix the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 for dense rows, 16-lane AVX-512 for block-quantized rows (half the unpacking instructions) and attention's
    /// weighted values (the same bits as AVX2's), and the AVX2 integer K-quant kernel with AVX-512's 32 vector
    /// registers (a group of 8 activation rows spills in 16).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    pub(super) fn detect() -> Kernel {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            let off = |v: &str| std::env::var_os(v).is_some();
            let available = Kernel::available();
            let best = available.last().copied().unwrap_or(Kernel::Scalar);
            match best {
                _ if off("FRSPEC_NO_SIMD") => Kernel::Scalar,
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512 if off("FRSPEC_NO_AVX512") => Kernel::Avx2,
                other => other,
            }
        })
    }

    /// Every kernel this CPU can run, simplest first.
    fn available() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut kernels = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            kernels.push(Kernel::Avx2);
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") {
                kernels.push(Kernel::Avx512);
            }
        }
        kernels
    }
}

/// Dot product of two f32 slices, with the same arithmetic as a weight row of f32 storage.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dots_f32::<1>(Kernel::detect(), a, b)[0]
}

/// `out[j] = dot(q, rows[j · stride..][..q.len()])`, the same bits as `dot` each: attention's scores, one query
/// against a cache's keys. The vector version takes four keys at a time on independent accumulators; one at a time, a
/// 64-wide dot waited on its own additions (16% of a profile of the target answering prompts of ≈ 300 tokens).
pub fn dots_strided(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    assert!(out.is_empty() || (out.len() - 1) * stride + q.len() <= rows.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(Kernel::detect(), Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: both kernels are only chosen when the CPU reports avx2, fma and f16c (`Kernel::available`); the
        // bounds are checked above.
        return unsafe { avx2::dots_strided(q, rows, stride, out) };
    }
    out.iter_mut().enumerate().for_each(|(j, o)| *o = dot(q, &rows[j * stride..j * stride + q.len()]));
}

/// `out[i] = Σ_j weights[j] · rows[j · stride + i]` over j in order, each term multiplied and then added (two
/// roundings, from +0), as a plain loop computes it: attention's probability-weighted values. The vector version keeps
/// 64 sums in registers over all rows; the plain loop, compiled for the baseline's 4-lane vectors, loaded and stored
/// them again for every row (attention was 10.4% of a sampled sweep's profile on an AVX2 machine, 8.6% after).
/// Same bits on every kernel.
pub fn weighted_rows(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    assert!(weights.is_empty() || (weights.len() - 1) * stride + out.len() <= rows.len());
    #[cfg(target_arch = "x86_64")]
    match Kernel::detect() {
        // SAFETY: each kernel is only chosen when the CPU reports its features (`Kernel::available`); the bounds are
        // checked above.
        Kernel::Avx512 => return unsafe { avx512::weighted_rows(weights, rows, stride, out) },
        Kernel::Avx2 => return unsafe { avx2::weighted_rows(weights, rows, stride, out) },
        Kernel::Scalar => {}
    }
    weighted_rows_scalar(weights, rows, stride, out)
}

fn weighted_rows_scalar(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (j, w) in weights.iter().enumerate() {
        out.iter_mut().zip(&rows[j * stride..]).for_each(|(o, v)| *o += w * v);
    }
}

/// Returns the AVX-512 or AVX2 version of a block kernel when the process runs one.
macro_rules! vectorized {
    ($kernel:expr, $f:ident($($arg:expr),*)) => {
        #[cfg(target_arch = "x86_64")]
        match $kernel {
            // SAFETY: Kernel::Avx512 is only chosen when the CPU reports avx512f, avx512bw and avx512vl besides avx2, fma and
            // f16c, Kernel::Avx2 when it reports avx2, fma and f16c (`Kernel::available`).
            Kernel::Avx512 => return unsafe { avx512::$f::<N>($($arg),*) },
            Kernel::Avx2 => return unsafe { avx2::$f::<N>($($arg),*) },
            Kernel::Scalar => {}
        }
    };
}

// Each `dots_*::<N>` computes N dot products of one weight row with N consecutive activation rows of `x`.
// Output j depends only on the row and x[j], through the same operations for every N.

fn dots_f32<const N: usize>(kernel: Kernel, w: &[f32], x: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: these kernels are only chosen when the CPU reports avx2, fma and f16c.
        return unsafe { avx2::dots_f32::<N>(w, x) };
    }
    let _ = kernel;
    std::array::from_fn(|j| scalar_lanes(w.len(), |i| w[i] * x[j * w.len() + i]))
}

fn dots_f16<const N: usize>(kernel: Kernel, w: &[f16], x: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: as above.
        return unsafe { avx2::dots_f16::<N>(w, x) };
    }
    let _ = kernel;
    std::array::from_fn(|j| scalar_lanes(w.len(), |i| w[i].to_f32() * x[j * w.len() + i]))
}

/// A block type with its vector dequantization where the architecture has one.
#[cfg(target_arch = "x86_64")]
trait VBlock: Block + avx2::Dequantize + avx512::Dequantize {}
#[cfg(target_arch = "x86_64")]
impl<B: Block + avx2::Dequantize + avx512::Dequantize> VBlock for B {}
#[cfg(not(target_arch = "x86_64"))]
trait VBlock: Block {}
#[cfg(not(target_arch = "x86_64"))]
impl<B: Block> VBlock for B {}

/// Block-quantized rows: each block's weights (`Block::values`) times the activations, as for an f32 row.
fn dots_blocks<const N: usize>(kernel: Kernel, w: &[impl VBlock], x: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_blocks(w, x));
    let _ = kernel;
    scalar_chunks(w.len(), x, |i| w[i].values())
}

/// A K-quant super-block with its vector unpacking and integer products where the architecture has them.
#[cfg(target_arch = "x86_64")]
trait KBlock: avx2::Unpack + avx2::VectorDot {}
#[cfg(target_arch = "x86_64")]
impl<B: avx2::Unpack + avx2::VectorDot> KBlock for B {}
#[cfg(not(target_arch = "x86_64"))]
trait KBlock: SuperBlock + kquants::IntegerDot {}
#[cfg(not(target_arch = "x86_64"))]
impl<B: SuperBlock + kquants::IntegerDot> KBlock for B {}

/// K-quant rows with f32 activations: each sub-block of 32 as its weights `scale · v + offset` (one rounding, as
/// `kquants::dequantize`), then as any other block.
fn dots_k<const N: usize>(kernel: Kernel, w: &[impl KBlock], x: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_k(w, x));
    let _ = kernel;
    scalar_chunks(w.len() * SUBS, x, |i| {
        let (v, scale, offset) = w[i / SUBS].sub_block(i % SUBS);
        v.map(|v| scale.mul_add(v, offset))
    })
}

/// The scalar fallback over a row of `chunks` runs of 32 weights (`weights(i)` is run i), in eight lanes.
fn scalar_chunks<const N: usize>(chunks: usize, x: &[f32], weights: impl Fn(usize) -> [f32; QK]) -> [f32; N] {
    let cols = chunks * QK;
    let mut lanes = [[0f32; 8]; N];
    for i in 0..chunks {
        let w = weights(i);
        for (j, lanes) in lanes.iter_mut().enumerate() {
            for (t, (w, x)) in w.iter().zip(&x[j * cols + i * QK..j * cols + (i + 1) * QK]).enumerate() {
                lanes[t % 8] += w * x;
            }
        }
    }
    lanes.map(|l| l.iter().sum())
}

/// `kquants::quantize_q8k`, with vector instructions where the kernel has them (the same bits).
fn quantize_q8k(kernel: Kernel, x: &[f32], out: &mut Vec<BlockQ8K>) {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: these kernels are only chosen when the CPU reports avx2, fma and f16c.
        return unsafe { avx2::quantize_q8k(x, out) };
    }
    let _ = kernel;
    kquants::quantize_q8k(x, out)
}

/// Activation rows in blocks of 32 for the integer products of blocks of 32 (`q8::quantize_run`, with vector
/// instructions where the kernel has them: the same bits).
fn quantize_q8_32(kernel: Kernel, x: &[f32], out: &mut Q8Rows) {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: these kernels are only chosen when the CPU reports avx2, fma and f16c; runs are blocks of 32.
        return out.quantize(x, |xs, qs| unsafe { avx2::quantize_run(xs, qs) });
    }
    let _ = kernel;
    out.quantize(x, q8::quantize_run)
}

/// Rows of blocks of 32 (`w`: whole rows of `nb` blocks) times N activation rows in blocks of 32 (`a`): row r's
/// product with activation row j goes to `out[j · stride + r]`. AVX-512 VNNI's `vpdpbusd` where the CPU has it,
/// else AVX2's byte and word multiply-adds, else the scalar reference: the same bits on every kernel
/// (`q8::dot_row`).
#[allow(clippy::too_many_arguments)]
fn dots_q8_rows<const N: usize, B: Q8Block>(kernel: Kernel, w: &[B], nb: usize, a: &Q8View, cold: bool, out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        assert!((N - 1) * stride + w.len() / nb <= out.len() && a.qs.len() >= N * nb * QK && a.d.len() >= N * nb && a.sums.len() >= N * nb);
        // SAFETY: Kernel::Avx512 means avx512f/bw/vl, avx2, fma and f16c, and has_vnni() checked avx512vnni;
        // Kernel::Avx2 means avx2, fma and f16c. The bounds are checked above.
        return unsafe {
            match kernel {
                Kernel::Avx512 if has_vnni() => q8::avx512::dots_rows::<N, B>(w, nb, a, cold, out, stride),
                _ => q8::avx2::dots_rows::<N, B>(w, nb, a, cold, out, stride),
            }
        };
    }
    let _ = (kernel, cold);
    q8::dots_rows_scalar::<N, B>(w, nb, a, out, stride)
}

/// Whether the CPU has AVX-512 VNNI (the integer products of `dots_q8_rows`).
#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
}

/// A block of 32 with its integer products where the architecture has them.
#[cfg(target_arch = "x86_64")]
trait Q8Block: q8::VectorBlock {}
#[cfg(target_arch = "x86_64")]
impl<B: q8::VectorBlock> Q8Block for B {}
#[cfg(not(target_arch = "x86_64"))]
trait Q8Block: q8::IntBlock {}
#[cfg(not(target_arch = "x86_64"))]
impl<B: q8::IntBlock> Q8Block for B {}

/// K-quant rows (`w`: whole rows of `nk` super-blocks) times N Q8_K activation rows (`a`, `nk` blocks each): row r's
/// product with activation row j goes to `out[j · stride + r]`. Per super-block the integer products of
/// `IntegerDot`, in order.
fn dots_k8_rows<const N: usize, B: KBlock>(kernel: Kernel, w: &[B], nk: usize, a: &[BlockQ8K], out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        assert!((N - 1) * stride + w.len() / nk <= out.len() && a.len() >= N * nk);
        // SAFETY: the kernels are only chosen when the CPU has their features (`Kernel::available`); the bounds are
        // checked above.
        return unsafe {
            match kernel {
                Kernel::Avx512 => avx512::dots_k8_rows::<N>(w, nk, a, out, stride),
                _ => avx2::dots_k8_rows::<N>(w, nk, a, out, stride),
            }
        };
    }
    let _ = kernel;
    for (r, row) in w.chunks_exact(nk).enumerate() {
        for j in 0..N {
            out[j * stride + r] = row.iter().enumerate().map(|(i, b)| b.dot_q8k(&a[j * nk + i])).sum();
        }
    }
}

/// Eight-lane accumulation in the scalar fallback, so it degrades gracefully on long rows.
fn scalar_lanes(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    for i in 0..n {
        lanes[i % 8] += term(i);
    }
    lanes.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::kquants::{scale_min, scales_mins, IntegerDot, ScaleMinBlock};
    use super::{Block, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ6K, BlockQ8K, BlockQ8_0, SuperBlock, QK, QK_K, SUBS};
    use half::f16;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// f16 → f32 with the F16C instruction, inlined (half's conversion is an out-of-line call per value).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn to_f32(h: f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
    }

    /// Plain rows: two accumulators per activation row over 16-element steps, then a scalar tail. Activation row j
    /// starts at `x[j · stride]` (`stride` ≥ n: consecutive rows, or a cache's keys).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_dense<const N: usize>(n: usize, x: &[f32], stride: usize, load: impl Fn(usize) -> __m256, at: impl Fn(usize) -> f32) -> [f32; N] {
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut i = 0;
        while i + 16 <= n {
            let w0 = load(i);
            let w1 = load(i + 8);
            for (j, a) in acc.iter_mut().enumerate() {
                let xp = x.as_ptr().add(j * stride + i);
                a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), a[0]);
                a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(8)), a[1]);
            }
            i += 16;
        }
        std::array::from_fn(|j| {
            let mut s = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
            for t in i..n {
                s += at(t) * x[j * stride + t];
            }
            s
        })
    }

    /// `super::dots_strided`: `dots_dense` over the strided rows, four at a time.
    ///
    /// # Safety
    /// On a CPU with avx2, fma and f16c; `rows` reaches `(out.len() − 1) · stride + q.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_strided(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let (n, load, at) = (q.len(), |i: usize| _mm256_loadu_ps(q.as_ptr().add(i)), |i: usize| q[i]);
        let done = out.len() / 4 * 4;
        for (j, o) in out[..done].chunks_exact_mut(4).enumerate() {
            o.copy_from_slice(&dots_dense::<4>(n, &rows[4 * j * stride..], stride, load, at));
        }
        for (r, o) in out.iter_mut().enumerate().skip(done) {
            *o = dots_dense::<1>(n, &rows[r * stride..], stride, load, at)[0];
        }
    }

    /// `super::weighted_rows`, 64 columns at a time in 8 registers (then 8 at a time, then one by one).
    ///
    /// # Safety
    /// On a CPU with avx2; `rows` reaches `(weights.len() − 1) · stride + out.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn weighted_rows(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let mut c = 0;
        while c + 64 <= out.len() {
            weighted_columns::<8>(weights, rows, stride, &mut out[c..], c);
            c += 64;
        }
        while c + 8 <= out.len() {
            weighted_columns::<1>(weights, rows, stride, &mut out[c..], c);
            c += 8;
        }
        super::weighted_rows_scalar(weights, &rows[c..], stride, &mut out[c..]);
    }

    /// Columns `c..c + 8K` of `weighted_rows` into `out[..8K]`, their sums held in K registers over all rows.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn weighted_columns<const K: usize>(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32], c: usize) {
        let mut sums = [_mm256_setzero_ps(); K];
        for (j, &w) in weights.iter().enumerate() {
            let (w, v) = (_mm256_set1_ps(w), rows.as_ptr().add(j * stride + c));
            for (k, sum) in sums.iter_mut().enumerate() {
                *sum = _mm256_add_ps(*sum, _mm256_mul_ps(w, _mm256_loadu_ps(v.add(8 * k))));
            }
        }
        for (k, sum) in sums.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * k), *sum);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_f32<const N: usize>(w: &[f32], x: &[f32]) -> [f32; N] {
        dots_dense::<N>(w.len(), x, w.len(), |i| _mm256_loadu_ps(w.as_ptr().add(i)), |i| w[i])
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_f16<const N: usize>(w: &[f16], x: &[f32]) -> [f32; N] {
        dots_dense::<N>(
            w.len(),
            x,
            w.len(),
            |i| _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(i) as *const __m128i)),
            |i| to_f32(w[i]),
        )
    }

    /// The 32 nibbles of a block, as four vectors of 8 f32 in element order (low nibbles are elements 0..16).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles(qs: &[u8; QK / 2]) -> [__m256; 4] {
        let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
        ]
    }

    /// An f16 in every lane (see `avx512::splat`: a scalar conversion may chain blocks through an accumulator).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splat(h: f16) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16(h.to_bits() as i16))
    }

    /// The 32 signed bytes of a Q8_0 block as four vectors of 8 f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bytes(qs: &[i8; QK]) -> [__m256; 4] {
        let p = qs.as_ptr() as *const __m128i;
        let (lo, hi) = (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)));
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
        ]
    }

    /// A block's weights as four vectors of 8 f32: the values of `Block::values`, by the same operations.
    pub trait Dequantize: Block {
        /// # Safety
        /// Only on a CPU with avx2, fma and f16c.
        unsafe fn weights(&self) -> [__m256; 4];
    }

    impl Dequantize for BlockQ4_0 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m256; 4] {
            let (d, eight) = (splat(self.d), _mm256_set1_ps(8.0));
            let q = nibbles(&self.qs);
            [
                _mm256_mul_ps(d, _mm256_sub_ps(q[0], eight)),
                _mm256_mul_ps(d, _mm256_sub_ps(q[1], eight)),
                _mm256_mul_ps(d, _mm256_sub_ps(q[2], eight)),
                _mm256_mul_ps(d, _mm256_sub_ps(q[3], eight)),
            ]
        }
    }

    impl Dequantize for BlockQ4_1 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m256; 4] {
            let (d, m) = (splat(self.d), splat(self.m));
            let q = nibbles(&self.qs);
            [_mm256_fmadd_ps(d, q[0], m), _mm256_fmadd_ps(d, q[1], m), _mm256_fmadd_ps(d, q[2], m), _mm256_fmadd_ps(d, q[3], m)]
        }
    }

    impl Dequantize for BlockQ8_0 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m256; 4] {
            let d = splat(self.d);
            let q = bytes(&self.qs);
            [_mm256_mul_ps(d, q[0]), _mm256_mul_ps(d, q[1]), _mm256_mul_ps(d, q[2]), _mm256_mul_ps(d, q[3])]
        }
    }

    /// A row as runs of 32 f32 weights (blocks, or K-quant sub-blocks), for `dots_chunks`.
    pub trait Chunks {
        /// # Safety
        /// Only on a CPU with avx2, fma and f16c; `i` < the row's runs.
        unsafe fn chunk(&self, i: usize) -> [__m256; 4];
    }

    impl<B: Dequantize> Chunks for [B] {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn chunk(&self, i: usize) -> [__m256; 4] {
            self.get_unchecked(i).weights()
        }
    }

    /// K-quant super-blocks seen as their sub-blocks' weights `scale · v + offset`.
    pub struct SubBlocks<'a, B>(pub &'a [B]);

    impl<B: Unpack> Chunks for SubBlocks<'_, B> {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn chunk(&self, i: usize) -> [__m256; 4] {
            let (v, scale, offset) = self.0.get_unchecked(i / SUBS).unpack(i % SUBS);
            let (scale, offset) = (_mm256_set1_ps(scale), _mm256_set1_ps(offset));
            [
                _mm256_fmadd_ps(scale, v[0], offset),
                _mm256_fmadd_ps(scale, v[1], offset),
                _mm256_fmadd_ps(scale, v[2], offset),
                _mm256_fmadd_ps(scale, v[3], offset),
            ]
        }
    }

    /// `chunks` runs of 32 weights times N activation rows: per row and run, the four products summed, then added
    /// to the row's accumulator.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_chunks<const N: usize>(chunks: usize, w: &(impl Chunks + ?Sized), x: &[f32]) -> [f32; N] {
        let cols = chunks * QK;
        let mut acc = [_mm256_setzero_ps(); N];
        for i in 0..chunks {
            let w = w.chunk(i);
            for (j, a) in acc.iter_mut().enumerate() {
                let x = x.as_ptr().add(j * cols + i * QK);
                let p = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
                let p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x.add(8)), p);
                let p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x.add(16)), p);
                *a = _mm256_add_ps(*a, _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x.add(24)), p));
            }
        }
        std::array::from_fn(|j| hsum(acc[j]))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_blocks<const N: usize>(w: &[impl Dequantize], x: &[f32]) -> [f32; N] {
        dots_chunks::<N>(w.len(), w, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_k<const N: usize>(w: &[impl Unpack], x: &[f32]) -> [f32; N] {
        dots_chunks::<N>(w.len() * SUBS, &SubBlocks(w), x)
    }

    /// K-quant rows times Q8_K activation rows, as the scalar `dots_k8_rows`, with the products kept in 8 f32 lanes
    /// per activation row and summed once per weight row (as ggml does). No closures on this path: a closure does
    /// not take its function's target features, so it would not be inlined.
    ///
    /// # Safety
    /// On a CPU with avx2, fma and f16c; `a` holds N rows of `nk` blocks and `out` reaches `(N − 1) · stride + rows`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_k8_rows<const N: usize>(w: &[impl VectorDot], nk: usize, a: &[BlockQ8K], out: &mut [f32], stride: usize) {
        let mut rows = [&a[0]; N];
        for (r, row) in w.chunks_exact(nk).enumerate() {
            let mut acc = [_mm256_setzero_ps(); N];
            for (i, b) in row.iter().enumerate() {
                for (j, at) in rows.iter_mut().enumerate() {
                    *at = a.get_unchecked(j * nk + i);
                }
                b.accumulate::<N>(&rows, &mut acc);
            }
            for (j, acc) in acc.iter().enumerate() {
                *out.get_unchecked_mut(j * stride + r) = hsum(*acc);
            }
        }
    }

    /// One super-block times N Q8_K activation blocks (`IntegerDot::dot_q8k` for each), added to 8 f32 lanes per
    /// activation row with exact integer sums inside the super-block.
    pub trait VectorDot: IntegerDot {
        /// # Safety
        /// Only on a CPU with avx2, fma and f16c.
        unsafe fn accumulate<const N: usize>(&self, a: &[&BlockQ8K; N], acc: &mut [__m256; N]);
    }

    /// `quantize_q8k` with vector instructions, to the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_q8k(x: &[f32], out: &mut Vec<BlockQ8K>) {
        for xs in x.chunks_exact(QK_K) {
            let mut b = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] };
            b.d = quantize_run(xs, &mut b.qs);
            super::kquants::sum_sixteens(&mut b);
            out.push(b);
        }
    }

    /// `q8::quantize_run` with vector instructions, to the same bits (max, the multiply and ties-to-even rounding are
    /// the same IEEE operations; the packing saturates where the scalar version clamps, at ±127 already).
    ///
    /// # Safety
    /// On a CPU with avx2 and fma; `xs.len()` a multiple of 32 and `qs` at least as long.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_run(xs: &[f32], qs: &mut [i8]) -> f32 {
        assert!(xs.len() % QK == 0 && qs.len() >= xs.len());
        let sign = _mm256_set1_ps(-0.0);
        let p = xs.as_ptr();
        let mut m = _mm256_setzero_ps();
        for i in (0..xs.len()).step_by(8) {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(i))));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        if amax == 0.0 {
            qs[..xs.len()].fill(0);
            return 0.0;
        }
        let iscale = _mm256_set1_ps(127.0 / amax);
        // packs interleave 128-bit lanes: dwords come out as (0 4 1 5 2 6 3 7).
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for i in (0..xs.len()).step_by(32) {
            let lo = _mm256_packs_epi32(round8(p.add(i), iscale), round8(p.add(i + 8), iscale));
            let hi = _mm256_packs_epi32(round8(p.add(i + 16), iscale), round8(p.add(i + 24), iscale));
            let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
            _mm256_storeu_si256(qs.as_mut_ptr().add(i) as *mut __m256i, q);
        }
        amax / 127.0
    }

    /// Eight values times `scale`, rounded to the nearest integer (ties to even).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn round8(p: *const f32, scale: __m256) -> __m256i {
        _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(_mm256_loadu_ps(p), scale)))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(p: *const i8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// Q4_K and Q5_K super-blocks as the integer kernel reads them.
    pub trait Q4Like: ScaleMinBlock {
        /// Values 64c .. 64c + 64 as unsigned bytes: sub-block 2c, then 2c + 1.
        /// # Safety
        /// Only on a CPU with avx2.
        unsafe fn values(&self, c: usize) -> (__m256i, __m256i);
    }

    impl Q4Like for BlockQ4K {
        /// Sub-block 2c is the low nibbles of bytes 32c .. 32c + 32, sub-block 2c + 1 their high nibbles.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn values(&self, c: usize) -> (__m256i, __m256i) {
            let p = self.qs.as_ptr().add(32 * c);
            (nibbles32(p, false), nibbles32(p, true))
        }
    }

    impl Q4Like for BlockQ5K {
        /// As Q4_K, with bit s of each qh byte as the fifth bit (16) of that value of sub-block s.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn values(&self, c: usize) -> (__m256i, __m256i) {
            let p = self.qs.as_ptr().add(32 * c);
            let qh = _mm256_loadu_si256(self.qh.as_ptr() as *const __m256i);
            let (lo_bit, hi_bit) = (_mm256_set1_epi8((1u8 << (2 * c)) as i8), _mm256_set1_epi8((2u8 << (2 * c)) as i8));
            let sixteen = _mm256_set1_epi8(16);
            let lo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, lo_bit), lo_bit), sixteen);
            let hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, hi_bit), hi_bit), sixteen);
            (_mm256_or_si256(nibbles32(p, false), lo), _mm256_or_si256(nibbles32(p, true), hi))
        }
    }

    /// Q4_K and Q5_K: 64 values at a time (`Q4Like::values`), each pair of products summed to i16 (`maddubs`:
    /// |31 · 127 · 2| fits) then times the sub-block scale to i32 (`madd`). The mins term: the mins (as i16) times
    /// the activation sums of each sub-block (two sums of 16, added), as `kquants::mins_term`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate_q4k_like<const N: usize>(b: &impl Q4Like, a: &[&BlockQ8K; N], acc: &mut [__m256; N]) {
        let (d, dmin, scales) = b.header();
        let (sc, mins) = scales_mins(scales);
        let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
        let mut sumi = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let (lo, hi) = b.values(c);
            let (s_lo, s_hi) = (_mm256_set1_epi16(sc[2 * c] as i16), _mm256_set1_epi16(sc[2 * c + 1] as i16));
            for j in 0..N {
                let q = a[j].qs.as_ptr().add(64 * c);
                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(q)), s_lo);
                let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(q.add(32))), s_hi);
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(pl, ph));
            }
        }
        let (d, dmin) = (to_f32(d), to_f32(dmin));
        for j in 0..N {
            let sums = _mm256_loadu_si256(a[j].bsums.as_ptr() as *const __m256i);
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            let m = _mm256_insertf128_ps::<0>(_mm256_setzero_ps(), _mm_cvtepi32_ps(_mm_madd_epi16(mins, pairs)));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[j].d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * a[j].d), m, acc[j]);
        }
    }

    impl VectorDot for BlockQ4K {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn accumulate<const N: usize>(&self, a: &[&BlockQ8K; N], acc: &mut [__m256; N]) {
            accumulate_q4k_like(self, a, acc)
        }
    }

    impl VectorDot for BlockQ5K {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn accumulate<const N: usize>(&self, a: &[&BlockQ8K; N], acc: &mut [__m256; N]) {
            accumulate_q4k_like(self, a, acc)
        }
    }

    impl VectorDot for BlockQ6K {
        /// Per half of 128 values (its 64 `ql` and 32 `qh` bytes read once): four sub-blocks of 32 unsigned 6-bit
        /// values (0..63) times the activations, pairs summed to i16, then times the two sub-scales of each sub-block's
        /// halves (`madd` with 8 lanes of each). The −32 offset: the sixteen scales times the activation sums.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn accumulate<const N: usize>(&self, a: &[&BlockQ8K; N], acc: &mut [__m256; N]) {
            let mut sumi = [_mm256_setzero_si256(); N];
            let (three, fifteen) = (_mm256_set1_epi8(3), _mm256_set1_epi8(0x0f));
            for h in 0..2 {
                let ql = self.ql.as_ptr().add(64 * h);
                let ql = [_mm256_loadu_si256(ql as *const __m256i), _mm256_loadu_si256(ql.add(32) as *const __m256i)];
                let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * h) as *const __m256i);
                for k in 0..4 {
                    let low = if k < 2 { ql[k] } else { _mm256_srli_epi16(ql[k - 2], 4) };
                    let two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), three);
                    let q = _mm256_or_si256(_mm256_and_si256(low, fifteen), _mm256_slli_epi16(two, 4));
                    let g = 8 * h + 2 * k;
                    let scales = _mm256_set_m128i(_mm_set1_epi16(self.scales[g + 1] as i16), _mm_set1_epi16(self.scales[g] as i16));
                    let s = 4 * h + k;
                    for j in 0..N {
                        let p = _mm256_maddubs_epi16(q, load(a[j].qs.as_ptr().add(32 * s)));
                        sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(p, scales));
                    }
                }
            }
            let d = to_f32(self.d);
            // Group g of 16 values (g = 2s + half = 8h + 2k + half) has scale g and activation sum g.
            let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const __m128i));
            for j in 0..N {
                let offset = _mm256_madd_epi16(scales, _mm256_loadu_si256(a[j].bsums.as_ptr() as *const __m256i));
                let total = _mm256_sub_epi32(sumi[j], _mm256_slli_epi32(offset, 5));
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[j].d), _mm256_cvtepi32_ps(total), acc[j]);
            }
        }
    }

    /// Sub-block `s` of a K-quant super-block as four vectors of 8 f32, its scale and its offset.
    pub trait Unpack: SuperBlock {
        /// # Safety
        /// Only on a CPU with avx2, fma and f16c.
        unsafe fn unpack(&self, s: usize) -> ([__m256; 4], f32, f32);
    }

    /// 32 bytes as four vectors of 8 f32, in order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen(v: __m256i) -> [__m256; 4] {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let f = |b: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
    }

    /// The low (`high` false) or high nibbles of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles32(p: *const u8, high: bool) -> __m256i {
        let raw = _mm256_loadu_si256(p as *const __m256i);
        let raw = if high { _mm256_srli_epi16(raw, 4) } else { raw };
        _mm256_and_si256(raw, _mm256_set1_epi8(0x0f))
    }

    impl Unpack for BlockQ4K {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn unpack(&self, s: usize) -> ([__m256; 4], f32, f32) {
            let (sc, m) = scale_min(s, &self.scales);
            (widen(nibbles32(self.qs.as_ptr().add(32 * (s / 2)), s % 2 == 1)), to_f32(self.d) * sc, -to_f32(self.dmin) * m)
        }
    }

    impl Unpack for BlockQ5K {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn unpack(&self, s: usize) -> ([__m256; 4], f32, f32) {
            let (sc, m) = scale_min(s, &self.scales);
            let q = nibbles32(self.qs.as_ptr().add(32 * (s / 2)), s % 2 == 1);
            // Bit s of each qh byte is that value's fifth bit: 16 where set.
            let bit = _mm256_set1_epi8((1u8 << s) as i8);
            let qh = _mm256_loadu_si256(self.qh.as_ptr() as *const __m256i);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            let q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
            (widen(q), to_f32(self.d) * sc, -to_f32(self.dmin) * m)
        }
    }

    impl Unpack for BlockQ6K {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn unpack(&self, s: usize) -> ([__m256; 4], f32, f32) {
            let (h, k) = (s / 4, s % 4);
            let low = nibbles32(self.ql.as_ptr().add(64 * h + 32 * (k % 2)), k >= 2);
            let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * h) as *const __m256i);
            // Two bits at 2k of each qh byte, moved to bits 4-5 (masked first, so no bit crosses into the next byte).
            let two = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3));
            let q = widen(_mm256_or_si256(low, _mm256_slli_epi16(two, 4)));
            let thirty_two = _mm256_set1_ps(32.0);
            let sc = |i: usize| _mm256_set1_ps(self.scales[8 * h + 2 * k + i] as f32);
            let v = [0, 1, 2, 3].map(|i| _mm256_mul_ps(sc(i / 2), _mm256_sub_ps(q[i], thirty_two)));
            (v, to_f32(self.d), 0.0)
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{SubBlocks, Unpack, VectorDot};
    use super::kquants::BlockQ8K;
    use super::{Block, BlockQ4_0, BlockQ4_1, BlockQ8_0, QK, SUBS};
    use half::f16;
    use std::arch::x86_64::*;

    /// `super::weighted_rows` with 16-lane registers, 64 columns at a time in 4 (then 16 at a time, then the AVX2
    /// version's 8 and the scalar loop): each column's sum is its own lane, so the bits are the AVX2 version's.
    ///
    /// # Safety
    /// On a CPU with avx512f and avx2; `rows` reaches `(weights.len() − 1) · stride + out.len()`.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn weighted_rows(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let mut c = 0;
        while c + 64 <= out.len() {
            weighted_columns::<4>(weights, rows, stride, &mut out[c..], c);
            c += 64;
        }
        while c + 16 <= out.len() {
            weighted_columns::<1>(weights, rows, stride, &mut out[c..], c);
            c += 16;
        }
        super::avx2::weighted_rows(weights, &rows[c..], stride, &mut out[c..]);
    }

    /// Columns `c..c + 16K` of `weighted_rows` into `out[..16K]`, their sums held in K registers over all rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn weighted_columns<const K: usize>(weights: &[f32], rows: &[f32], stride: usize, out: &mut [f32], c: usize) {
        let mut sums = [_mm512_setzero_ps(); K];
        for (j, &w) in weights.iter().enumerate() {
            let (w, v) = (_mm512_set1_ps(w), rows.as_ptr().add(j * stride + c));
            for (k, sum) in sums.iter_mut().enumerate() {
                *sum = _mm512_add_ps(*sum, _mm512_mul_ps(w, _mm512_loadu_ps(v.add(16 * k))));
            }
        }
        for (k, sum) in sums.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * k), *sum);
        }
    }

    /// An f16 in every lane. Converting a broadcast keeps the scale off the accumulators: a scalar conversion
    /// (`to_f32`) let the compiler merge into a register holding an accumulator, which chained every block to the
    /// one before (a third slower).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn splat(h: f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_set1_epi16(h.to_bits() as i16))
    }

    /// The 16 values a 4-bit block can hold, as f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> __m512 {
        _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0)
    }

    /// Each nibble of a 4-bit block replaced by its entry in `table` (the block's 16 possible weights): the permute
    /// reads only the low 4 bits of each 32-bit index, so one widening serves both nibbles. Two permutes replace
    /// the conversion and scaling of 32 values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn lookup(qs: &[u8; QK / 2], table: __m512) -> [__m512; 2] {
        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.as_ptr() as *const __m128i));
        [_mm512_permutexvar_ps(bytes, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table)]
    }

    /// A block's weights as two vectors of 16 f32: the values of `Block::values`, by the same operations.
    pub trait Dequantize: Block {
        /// # Safety
        /// Only on a CPU with avx512f, avx512bw, avx2, fma and f16c.
        unsafe fn weights(&self) -> [__m512; 2];
    }

    impl Dequantize for BlockQ4_0 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m512; 2] {
            lookup(&self.qs, _mm512_mul_ps(splat(self.d), _mm512_sub_ps(levels(), _mm512_set1_ps(8.0))))
        }
    }

    impl Dequantize for BlockQ4_1 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m512; 2] {
            // d and m are adjacent f16s: one 32-bit broadcast converts both ([d, m, d, m, …]), then each fills its
            // vector (two fewer conversions than splatting each).
            let pair = std::ptr::read_unaligned(self as *const BlockQ4_1 as *const i32);
            let dm = _mm512_cvtph_ps(_mm256_set1_epi32(pair));
            lookup(&self.qs, _mm512_fmadd_ps(_mm512_permute_ps::<0b0000_0000>(dm), levels(), _mm512_permute_ps::<0b0101_0101>(dm)))
        }
    }

    impl Dequantize for BlockQ8_0 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn weights(&self) -> [__m512; 2] {
            let d = splat(self.d);
            let p = self.qs.as_ptr() as *const __m128i;
            [
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)))),
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(1))))),
            ]
        }
    }

    /// A row as runs of 32 f32 weights, for `dots_chunks`.
    pub trait Chunks {
        /// # Safety
        /// Only on a CPU with avx512f, avx512bw, avx2, fma and f16c; `i` < the row's runs.
        unsafe fn chunk(&self, i: usize) -> [__m512; 2];
    }

    impl<B: Dequantize> Chunks for [B] {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn chunk(&self, i: usize) -> [__m512; 2] {
            self.get_unchecked(i).weights()
        }
    }

    /// Two 8-lane vectors as one of 16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn join(a: __m256, b: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b)))
    }

    /// The AVX2 unpacking of K-quant sub-blocks, its four 8-lane vectors joined in pairs, then `scale · v + offset`.
    impl<B: Unpack> Chunks for SubBlocks<'_, B> {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        unsafe fn chunk(&self, i: usize) -> [__m512; 2] {
            let (v, scale, offset) = self.0.get_unchecked(i / SUBS).unpack(i % SUBS);
            let (scale, offset) = (_mm512_set1_ps(scale), _mm512_set1_ps(offset));
            [_mm512_fmadd_ps(scale, join(v[0], v[1]), offset), _mm512_fmadd_ps(scale, join(v[2], v[3]), offset)]
        }
    }

    /// `chunks` runs of 32 weights times N activation rows, two accumulators per row (one per half of a run), so
    /// that one row alone still has two independent chains of fused multiply-adds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn dots_chunks<const N: usize>(chunks: usize, w: &(impl Chunks + ?Sized), x: &[f32]) -> [f32; N] {
        let cols = chunks * QK;
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for i in 0..chunks {
            let w = w.chunk(i);
            for (j, a) in acc.iter_mut().enumerate() {
                let x = x.as_ptr().add(j * cols + i * QK);
                a[0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), a[0]);
                a[1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x.add(16)), a[1]);
            }
        }
        std::array::from_fn(|j| _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_blocks<const N: usize>(w: &[impl Dequantize], x: &[f32]) -> [f32; N] {
        dots_chunks::<N>(w.len(), w, x)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_k<const N: usize>(w: &[impl Unpack], x: &[f32]) -> [f32; N] {
        dots_chunks::<N>(w.len() * SUBS, &SubBlocks(w), x)
    }

    /// `avx2::dots_k8_rows` compiled for AVX-512 (VL): the same instructions, twice the registers.
    ///
    /// # Safety
    /// As `avx2::dots_k8_rows`, on a CPU with avx512f, avx512bw and avx512vl.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dots_k8_rows<const N: usize>(w: &[impl VectorDot], nk: usize, a: &[BlockQ8K], out: &mut [f32], stride: usize) {
        super::avx2::dots_k8_rows::<N>(w, nk, a, out, stride)
    }

}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_q4_1(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Matrix {
        let blocks = (0..rows * cols / QK)
            .map(|_| BlockQ4_1 {
                d: f16::from_f32(rng.random_range(0.001..0.05)),
                m: f16::from_f32(rng.random_range(-0.2..0.0)),
                qs: std::array::from_fn(|_| rng.random()),
            })
            .collect();
        Matrix { rows, cols, storage: Storage::Q4_1(blocks) }
    }

    fn dense(m: &Matrix) -> Vec<f32> {
        let mut out = vec![0.0; m.rows * m.cols];
        for (r, row) in out.chunks_exact_mut(m.cols).enumerate() {
            m.row_into(r, row);
        }
        out
    }

    /// The same matrix in every storage this module has a kernel for.
    fn all_storages(m: &Matrix, rng: &mut ChaCha8Rng) -> Vec<Matrix> {
        let Storage::Q4_1(q41) = &m.storage else { unreachable!("all_storages starts from Q4_1 rows") };
        let w = dense(m);
        let n = m.rows * m.cols / QK;
        let q8: Vec<BlockQ8_0> = (0..n).map(|_| BlockQ8_0 { d: f16::from_f32(rng.random_range(0.001..0.02)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        let q4 = (0..n).map(|_| BlockQ4_0 { d: f16::from_f32(rng.random_range(0.001..0.05)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        vec![
            m.clone(),
            Matrix { storage: Storage::Q8_0(q8.clone()), ..m.clone() },
            Matrix { storage: Storage::Q8_0Interleaved(q8::Interleaved::new(&q8, m.cols / QK)), ..m.clone() },
            Matrix { storage: Storage::Q4_1Interleaved(q8::Interleaved::new(q41, m.cols / QK)), ..m.clone() },
            Matrix { storage: Storage::Q4_0(q4), ..m.clone() },
            Matrix { storage: Storage::F16(w.iter().map(|v| f16::from_f32(*v)).collect()), ..m.clone() },
            Matrix { storage: Storage::F32(w), ..m.clone() },
        ]
    }

    #[test]
    fn every_kernel_matches_the_dequantized_reference_and_a_block_equals_its_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // 9 and 17 rows of activations: more than one group (8 rows, 16 for integer blocks of 32). Rows of 3 blocks (one pair and an odd one for the
        // integer kernel) and of 18 (SmolLM2's width: Q4_1 offsets in more than one run of 16 blocks).
        for (rows, cols, n) in [(70, 96, 9), (20, 576, 17)] {
            let q41 = random_q4_1(rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            for m in all_storages(&q41, &mut rng) {
                kernels_agree(&m, &dense(&m), &x, Activations::F32, |_| 1e-4);
                // Integer products: exact sums of the quantized activations, combined in f32.
                kernels_agree(&m, &dense(&m), &x, Activations::Q8, |scale| 1e-5 * scale);
            }
        }
    }

    /// Attention's weighted values: the vector versions give the plain loop's bits, for 64-, 16-, 8- and 1-column
    /// pieces, no rows and a row stride wider than the columns (and the values tell two roundings from one).
    #[test]
    fn weighted_rows_give_the_plain_loops_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        for (n, cols, stride) in [(1, 64, 64), (37, 75, 192), (37, 91, 192), (5, 3, 7), (0, 16, 16)] {
            let weights: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..1.0)).collect();
            let rows: Vec<f32> = (0..n.max(1) * stride).map(|_| rng.random_range(-3.0..3.0)).collect();
            let mut plain = vec![f32::NAN; cols];
            weighted_rows_scalar(&weights, &rows, stride, &mut plain);
            for kernel in Kernel::available() {
                let mut got = vec![f32::NAN; cols];
                match kernel {
                    Kernel::Scalar => weighted_rows_scalar(&weights, &rows, stride, &mut got),
                    // SAFETY: `available` lists the kernels the CPU runs.
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 => unsafe { avx2::weighted_rows(&weights, &rows, stride, &mut got) },
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512 => unsafe { avx512::weighted_rows(&weights, &rows, stride, &mut got) },
                }
                assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{kernel:?}: {n} rows of {cols}");
            }
            let fused = (0..cols).map(|i| (0..n).fold(0f32, |o, j| weights[j].mul_add(rows[j * stride + i], o)));
            assert!(n < 2 || fused.zip(&plain).any(|(f, p)| f != *p), "the case cannot tell two roundings from one");
        }
    }

    /// Attention's scores: each of a query's dots with strided keys has `dot`'s bits, four keys at a time and the
    /// rest one by one, for head widths with and without a tail past 16 lanes.
    #[test]
    fn strided_dots_give_dots_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        for (keys, d, stride) in [(0, 64, 192), (1, 64, 192), (7, 64, 192), (37, 75, 80), (9, 5, 5)] {
            let q: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
            let rows: Vec<f32> = (0..keys * stride + d).map(|_| rng.random_range(-3.0..3.0)).collect();
            let mut got = vec![f32::NAN; keys];
            dots_strided(&q, &rows, stride, &mut got);
            let want: Vec<u32> = (0..keys).map(|j| dot(&q, &rows[j * stride..j * stride + d]).to_bits()).collect();
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{keys} keys of {d}");
        }
    }

    /// Integer products of blocks of 32 follow one arithmetic (`q8::dot_row`): the vector kernels' rows a lane (16 with
    /// AVX-512 VNNI, 8 with AVX2), masked lanes for the last rows included, give the scalar reference's bits, for a
    /// few activation rows and for a full group of 16 and one more (the AVX-512 kernel writes each of the 16 out).
    #[test]
    fn integer_products_of_blocks_of_32_give_the_same_bits_on_every_kernel() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for (rows, cols, n) in [(37, 160, 3), (37, 160, 17)] {
            let q41 = random_q4_1(rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut scratch = MatmulScratch::default();
            for m in all_storages(&q41, &mut rng).iter().filter(|m| m.is_block_quant()) {
                let products: Vec<Vec<u32>> = Kernel::available()
                    .into_iter()
                    .map(|kernel| {
                        let mut out = vec![0.0; n * rows];
                        m.matmul_with(kernel, Activations::Q8, &x, &mut out, &mut scratch);
                        out.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                assert!(products.windows(2).all(|p| p[0] == p[1]), "{} × {n}: kernels differ", m.dtype_name());
            }
        }
    }

    /// The vector kernels' weights of each block (AVX-512's table lookup, AVX2's conversion) are `Block::values`,
    /// bit for bit, so that every kernel multiplies by the same weights.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_dequantization_gives_each_blocks_values() {
        use std::arch::x86_64::*;
        fn check<B: VBlock>(blocks: &[B], name: &str) {
            for kernel in Kernel::available() {
                for b in blocks {
                    let mut got = [0f32; QK];
                    // SAFETY: each kernel only where the CPU has its features (`Kernel::available`).
                    unsafe {
                        match kernel {
                            Kernel::Avx512 => {
                                let w = avx512::Dequantize::weights(b);
                                _mm512_storeu_ps(got.as_mut_ptr(), w[0]);
                                _mm512_storeu_ps(got.as_mut_ptr().add(16), w[1]);
                            }
                            Kernel::Avx2 => {
                                for (k, w) in avx2::Dequantize::weights(b).iter().enumerate() {
                                    _mm256_storeu_ps(got.as_mut_ptr().add(8 * k), *w);
                                }
                            }
                            Kernel::Scalar => continue,
                        }
                    }
                    assert_eq!(got.map(f32::to_bits), b.values().map(f32::to_bits), "{name} {kernel:?}");
                }
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut scale = || f16::from_f32(rng.random_range(-0.07f32..0.07));
        let scales: Vec<(f16, f16)> = (0..200).map(|_| (scale(), scale())).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let q4_1: Vec<BlockQ4_1> = scales.iter().map(|&(d, m)| BlockQ4_1 { d, m, qs: std::array::from_fn(|_| rng.random()) }).collect();
        let q4_0: Vec<BlockQ4_0> = q4_1.iter().map(|b| BlockQ4_0 { d: b.d, qs: b.qs }).collect();
        let q8_0: Vec<BlockQ8_0> = scales.iter().map(|&(d, _)| BlockQ8_0 { d, qs: std::array::from_fn(|_| rng.random()) }).collect();
        check(&q4_1, "q4_1");
        check(&q4_0, "q4_0");
        check(&q8_0, "q8_0");
    }

    /// Every kernel's product of `m` with each row of `x`: a block of rows equals the rows one by one, bit for bit,
    /// and each value lies within `tolerance(Σ |w x|)` of the exact product of `reference` (m's values) with the
    /// activations the kernel sees: `x`, or its Q8_K values where K-quant rows take integer products.
    fn kernels_agree(m: &Matrix, reference: &[f32], x: &[f32], activations: Activations, tolerance: impl Fn(f64) -> f64) {
        let (rows, cols) = (m.rows, m.cols);
        let n = x.len() / cols;
        let seen: Vec<f32> = if m.is_k_quant() && activations != Activations::F32 {
            let mut q8 = Vec::new();
            kquants::quantize_q8k(x, &mut q8);
            q8.iter().flat_map(|b| b.qs.map(|q| b.d * q as f32)).collect()
        } else if m.is_block_quant() && activations == Activations::Q8 {
            let mut q8 = Q8Rows::default();
            q8.quantize(x, q8::quantize_run);
            let quantized = q8.rows(0..n, cols / QK);
            quantized.qs.iter().enumerate().map(|(i, &q)| quantized.d[i / QK] * q as f32).collect()
        } else {
            x.to_vec()
        };
        let mut scratch = MatmulScratch::default();
        for kernel in Kernel::available() {
            let mut block = vec![0.0; n * rows];
            m.matmul_with(kernel, activations, x, &mut block, &mut scratch);
            for b in 0..n {
                let xb = &x[b * cols..(b + 1) * cols];
                let mut single = vec![0.0; rows];
                m.matmul_with(kernel, activations, xb, &mut single, &mut scratch);
                assert_eq!(&block[b * rows..(b + 1) * rows], &single[..], "{} {kernel:?}: block row {b} differs", m.dtype_name());
                for r in 0..rows {
                    let terms = || (0..cols).map(|c| reference[r * cols + c] as f64 * seen[b * cols + c] as f64);
                    let (exact, scale) = (terms().sum::<f64>(), terms().map(f64::abs).sum::<f64>());
                    let got = single[r] as f64;
                    assert!((got - exact).abs() <= tolerance(scale), "{} {kernel:?} row {r}: {got} vs {exact}", m.dtype_name());
                }
            }
        }
    }

    /// `w` quantized by candle (ggml's reference quantizer, ported) into `dtype`, and candle's dequantization of it.
    fn candle_quantized(w: &[f32], rows: usize, cols: usize, dtype: candle_core::quantized::GgmlDType) -> (Matrix, Vec<f32>) {
        let t = candle_core::Tensor::from_slice(w, (rows, cols), &candle_core::Device::Cpu).unwrap();
        let q = candle_core::quantized::QTensor::quantize(&t, dtype).unwrap();
        let reference = q.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bytes = q.data().unwrap();
        let storage = match dtype {
            candle_core::quantized::GgmlDType::Q4K => Storage::Q4K(kquants::parse(&bytes)),
            candle_core::quantized::GgmlDType::Q5K => Storage::Q5K(kquants::parse(&bytes)),
            _ => Storage::Q6K(kquants::parse(&bytes)),
        };
        (Matrix { rows, cols, storage }, reference)
    }

    #[test]
    fn k_quant_kernels_match_candles_dequantization_and_a_block_equals_its_rows() {
        use candle_core::quantized::GgmlDType;
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (rows, cols, n) = (20, 512, 9);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0) * rng.random_range(0.0f32..0.1)).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
            let (m, reference) = candle_quantized(&w, rows, cols, dtype);
            // The layout is read as ggml writes it: our dequantization is candle's, up to f32 rounding.
            let ours = dense(&m);
            let worst = ours.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "{}: dequantized values differ from candle's by {worst}", m.dtype_name());
            kernels_agree(&m, &reference, &x, Activations::F32, |scale| 1e-5 * scale);
            kernels_agree(&m, &reference, &x, Activations::KQuants, |scale| 1e-5 * scale);
            // The sliced head keeps K-quant rows as they are.
            let picked = m.select_rows(&[3, 17]);
            assert_eq!(dense(&picked), [&ours[3 * cols..4 * cols], &ours[17 * cols..18 * cols]].concat());
        }
    }

    #[test]
    fn products_in_one_parallel_region_equal_each_product_alone() {
        use candle_core::quantized::GgmlDType;
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let cols = 256;
        // Row counts that make task chunks cross from one matrix into the next (and start inside a group of 16
        // interleaved Q8_0 rows); enough work to run in parallel.
        let q41 = random_q4_1(37, cols, &mut rng);
        let blocks: Vec<BlockQ8_0> = (0..45 * cols / QK).map(|_| BlockQ8_0 { d: f16::from_f32(rng.random_range(0.001..0.02)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        let q8i = Matrix { rows: 45, cols, storage: Storage::Q8_0Interleaved(q8::Interleaved::new(&blocks, cols / QK)) };
        let w: Vec<f32> = (0..150 * cols).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let (q6k, _) = candle_quantized(&w, 150, cols, GgmlDType::Q6K);
        let f = Matrix { rows: 113, cols, storage: Storage::F32((0..113 * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect()) };
        let mut scratch = MatmulScratch::default();
        for n in [1, 5] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            for kernel in Kernel::available() {
                for activations in [Activations::F32, Activations::KQuants, Activations::Q8] {
                    let alone: Vec<Vec<f32>> = [&q41, &q8i, &q6k, &f]
                        .iter()
                        .map(|m| {
                            let mut out = vec![0.0; n * m.rows];
                            m.matmul_with(kernel, activations, &x, &mut out, &mut scratch);
                            out
                        })
                        .collect();
                    let (mut a, mut i, mut b, mut c) = (vec![0.0; n * 37], vec![0.0; n * 45], vec![0.0; n * 150], vec![0.0; n * 113]);
                    let products = &mut [(&q41, &mut a[..]), (&q8i, &mut i[..]), (&q6k, &mut b[..]), (&f, &mut c[..])];
                    Matrix::matmul_many_with(kernel, activations, &x, products, &mut scratch);
                    assert_eq!([a, i, b, c], &alone[..], "{kernel:?} {activations:?}, {n} rows: together differs from alone");
                }
            }
        }
    }

    #[test]
    fn every_kernel_quantizes_activations_to_the_same_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // A block whose largest magnitude is 127 (scale exactly 1, so every x.5 is a tie), a zero block, a random one.
        let ties = (0..QK_K).map(|i| if i == 0 { 127.0 } else { (i % 254) as f32 - 127.0 + 0.5 });
        let random = (0..QK_K).map(|_| rng.random_range(-3.0f32..3.0));
        let x: Vec<f32> = ties.chain(std::iter::repeat_n(0.0, QK_K)).chain(random).collect();
        let mut reference = Vec::new();
        kquants::quantize_q8k(&x, &mut reference);
        for kernel in Kernel::available() {
            let mut q = Vec::new();
            quantize_q8k(kernel, &x, &mut q);
            for (a, b) in q.iter().zip(&reference) {
                assert!(a.d == b.d && a.qs == b.qs && a.bsums == b.bsums, "{kernel:?} quantizes differently");
            }
        }
        assert_eq!(reference[0].qs[1..5], [-126, -124, -124, -122], "ties round to even");
        // Blocks of 32: the same rounding, block by block.
        let mut reference = Q8Rows::default();
        reference.quantize(&x, q8::quantize_run);
        let blocks = x.len() / QK;
        let same = |a: Q8View, b: Q8View| a.qs == b.qs && a.d == b.d && a.sums == b.sums;
        for kernel in Kernel::available() {
            let mut q = Q8Rows::default();
            quantize_q8_32(kernel, &x, &mut q);
            assert!(same(q.rows(0..1, blocks), reference.rows(0..1, blocks)), "{kernel:?} quantizes blocks of 32 differently");
        }
        assert_eq!(reference.rows(0..1, blocks).qs[1..5], [-126, -124, -124, -122], "ties round to even");
        // Rows quantized over longer ones left in the buffers are what they are alone.
        let mut fresh = Q8Rows::default();
        fresh.quantize(&x[x.len() - QK..], q8::quantize_run);
        reference.quantize(&x[x.len() - QK..], q8::quantize_run);
        assert!(same(reference.rows(0..1, 1), fresh.rows(0..1, 1)), "reused buffers change the quantized rows");
    }

    #[test]
    fn select_rows_keeps_the_chosen_rows_in_order() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let m = random_q4_1(10, 64, &mut rng);
        let picked = m.select_rows(&[7, 2, 9]);
        let (full, sub) = (dense(&m), dense(&picked));
        assert_eq!(&sub[..64], &full[7 * 64..8 * 64]);
        assert_eq!(&sub[64..128], &full[2 * 64..3 * 64]);
        assert_eq!(&sub[128..], &full[9 * 64..10 * 64]);
    }

    /// Interleaved Q8_0 and Q4_1 rows give back each block as it was, whole rows and chosen rows; rows of 3 blocks, so
    /// a group's last vector of Q8_0 scales is half used, and 37 rows, so its last group is partly filled.
    #[test]
    fn interleaved_rows_read_back_as_their_blocks() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let (rows, nb) = (37, 3);
        let q8_0: Vec<BlockQ8_0> = (0..rows * nb).map(|_| BlockQ8_0 { d: f16::from_f32(rng.random_range(-0.02..0.02)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        let q8_bits = |b: &BlockQ8_0| (b.d.to_bits(), b.qs.map(|q| q as u8).to_vec());
        check(&q8_0, nb, q8_bits, Storage::Q8_0, Storage::Q8_0Interleaved);
        let Storage::Q4_1(q4_1) = random_q4_1(rows, nb * QK, &mut rng).storage else { unreachable!() };
        let q4_bits = |b: &BlockQ4_1| (b.d.to_bits() as u32 | (b.m.to_bits() as u32) << 16, b.qs.to_vec());
        check(&q4_1, nb, q4_bits, Storage::Q4_1, Storage::Q4_1Interleaved);

        fn check<B: q8::Interleave, K: PartialEq + std::fmt::Debug>(blocks: &[B], nb: usize, bits: impl Fn(&B) -> K, plain: fn(Vec<B>) -> Storage, laid_out: fn(q8::Interleaved<B>) -> Storage) {
            let rows = blocks.len() / nb;
            let interleaved = q8::Interleaved::new(blocks, nb);
            assert_eq!(interleaved.blocks(0..rows).iter().map(&bits).collect::<Vec<_>>(), blocks.iter().map(&bits).collect::<Vec<_>>());
            let expected: Vec<_> = [36, 0, 17].iter().flat_map(|r| &blocks[r * nb..(r + 1) * nb]).map(&bits).collect();
            assert_eq!(interleaved.select_rows(&[36, 0, 17]).blocks(0..3).iter().map(&bits).collect::<Vec<_>>(), expected);
            let m = Matrix { rows, cols: nb * QK, storage: plain(blocks.to_vec()) };
            let i = Matrix { storage: laid_out(interleaved), ..m.clone() };
            assert_eq!(dense(&i), dense(&m));
        }
    }
}
