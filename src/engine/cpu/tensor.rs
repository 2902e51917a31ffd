//! Weight matrices and the CPU kernels that multiply them.
//!
//! Why hand-written rather than candle's CPU ops: speculative verification forwards a block of k+1 tokens and
//! must reproduce, bit for bit, what k+1 one-token forwards compute (greedy losslessness is tested exactly).
//! candle's gemm and quantized paths pick different summation orders for one row and for many (measured in
//! ../shared/reference/CRATES.md: up to 0.53 in a logit), quantize activations to 8 bits, and have no SIMD dot
//! product for Q4_1. Here every output element is one `dot` of one weight row with one activation row, always
//! in the same order, whatever the batch size or thread count; activations stay f32, so results follow an f32
//! reference that dequantizes the weights.

use super::kquants::{self, BlockQ4K, BlockQ5K, BlockQ6K, SuperBlock, QK_K, SUBS};
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
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
}

pub const QK: usize = 32;

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
            Storage::Q4_1(_) => "q4_1",
            Storage::Q8_0(_) => "q8_0",
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
            Storage::Q4_0(v) => {
                for (b, o) in v[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    let d = b.d.to_f32();
                    for j in 0..QK / 2 {
                        o[j] = d * ((b.qs[j] & 0x0f) as f32 - 8.0);
                        o[j + QK / 2] = d * ((b.qs[j] >> 4) as f32 - 8.0);
                    }
                }
            }
            Storage::Q4_1(v) => {
                for (b, o) in v[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    let (d, m) = (b.d.to_f32(), b.m.to_f32());
                    for j in 0..QK / 2 {
                        o[j] = d * (b.qs[j] & 0x0f) as f32 + m;
                        o[j + QK / 2] = d * (b.qs[j] >> 4) as f32 + m;
                    }
                }
            }
            Storage::Q8_0(v) => {
                for (b, o) in v[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    let d = b.d.to_f32();
                    o.iter_mut().zip(b.qs).for_each(|(o, q)| *o = d * q as f32);
                }
            }
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
            Storage::Q4K(v) => Storage::Q4K(gather(v, nk, ids)),
            Storage::Q5K(v) => Storage::Q5K(gather(v, nk, ids)),
            Storage::Q6K(v) => Storage::Q6K(gather(v, nk, ids)),
        };
        Matrix { rows: ids.len(), cols: self.cols, storage }
    }

    /// `out[b, r] = dot(W[r], x[b])` for `n = x.len() / cols` activation rows. Each weight row is unpacked once
    /// for up to `GROUP` activation rows at a time; each output still follows the exact operation sequence of a
    /// one-row product, so a block equals its rows done one by one, bit for bit.
    /// `scratch` holds per-block activation sums (Q4_1) and the transposed result; it is reused between calls.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        self.matmul_with(Kernel::detect(), x, out, scratch)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        let n = x.len() / self.cols;
        debug_assert_eq!(x.len(), n * self.cols);
        debug_assert_eq!(out.len(), n * self.rows);
        scratch.block_sums.clear();
        if let Storage::Q4_1(_) | Storage::Q4K(_) | Storage::Q5K(_) = self.storage {
            scratch.block_sums.extend(x.chunks_exact(QK).map(|c| c.iter().sum::<f32>()));
        }
        let sums = &scratch.block_sums;
        // Rows are split into chunks, one task each; the result is written row-major [rows, n] then transposed,
        // so each task owns a contiguous slice of the output.
        let rows_per_task = (self.rows / (4 * pool().current_num_threads())).clamp(16, 1024);
        let t = &mut scratch.transposed;
        t.resize(self.rows * n, 0.0);
        // Within a task, a tile of weight rows meets one group of activation rows at a time: the group stays in L1
        // and the tile in L2 however many rows the batch has (all rows against every weight row overflow L1 past
        // about 20 rows of 576 and ran a batch of verification blocks 1.5× slower than the blocks one by one).
        let task = |(task, chunk): (usize, &mut [f32])| {
            let first = task * rows_per_task;
            let rows_here = chunk.len() / n;
            for tile in (0..rows_here).step_by(ROW_TILE) {
                let mut b = 0;
                while b < n {
                    let g = (n - b).min(GROUP);
                    let xs = &x[b * self.cols..(b + g) * self.cols];
                    let ss = if sums.is_empty() { sums } else { &sums[b * self.blocks_per_row()..(b + g) * self.blocks_per_row()] };
                    for i in tile..(tile + ROW_TILE).min(rows_here) {
                        self.row_dots(kernel, first + i, xs, ss, &mut chunk[i * n + b..i * n + b + g]);
                    }
                    b += g;
                }
            }
        };
        // Waking the thread pool costs more than a small product (EAGLE heads, test models): stay on this thread.
        if self.rows * self.cols * n < PARALLEL_MIN_MACS {
            t.chunks_mut(rows_per_task * n).enumerate().for_each(task);
        } else {
            pool().install(|| t.par_chunks_mut(rows_per_task * n).enumerate().for_each(task));
        }
        for (r, row) in t.chunks_exact(n).enumerate() {
            for (b, v) in row.iter().enumerate() {
                out[b * self.rows + r] = *v;
            }
        }
    }

    /// Dots of row `r` with each of the `out.len()` (≤ GROUP) activation rows in `x`.
    #[inline]
    fn row_dots(&self, kernel: Kernel, r: usize, x: &[f32], block_sums: &[f32], out: &mut [f32]) {
        let (c, nb, nk) = (self.cols, self.blocks_per_row(), self.superblocks_per_row());
        macro_rules! group {
            ($f:ident, $w:expr) => {
                match out.len() {
                    1 => out.copy_from_slice(&$f::<1>(kernel, $w, x, block_sums)),
                    2 => out.copy_from_slice(&$f::<2>(kernel, $w, x, block_sums)),
                    3 => out.copy_from_slice(&$f::<3>(kernel, $w, x, block_sums)),
                    4 => out.copy_from_slice(&$f::<4>(kernel, $w, x, block_sums)),
                    5 => out.copy_from_slice(&$f::<5>(kernel, $w, x, block_sums)),
                    6 => out.copy_from_slice(&$f::<6>(kernel, $w, x, block_sums)),
                    7 => out.copy_from_slice(&$f::<7>(kernel, $w, x, block_sums)),
                    _ => out.copy_from_slice(&$f::<8>(kernel, $w, x, block_sums)),
                }
            };
        }
        match &self.storage {
            Storage::F32(v) => group!(dots_f32, &v[r * c..(r + 1) * c]),
            Storage::F16(v) => group!(dots_f16, &v[r * c..(r + 1) * c]),
            Storage::Q4_0(v) => group!(dots_q4_0, &v[r * nb..(r + 1) * nb]),
            Storage::Q4_1(v) => group!(dots_q4_1, &v[r * nb..(r + 1) * nb]),
            Storage::Q8_0(v) => group!(dots_q8_0, &v[r * nb..(r + 1) * nb]),
            Storage::Q4K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk]),
            Storage::Q5K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk]),
            Storage::Q6K(v) => group!(dots_k, &v[r * nk..(r + 1) * nk]),
        }
    }
}

/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// How many activation rows share one unpacking of a weight row (bounded by the 16 vector registers).
const GROUP: usize = 8;

/// Weight rows a task takes through every activation group before moving on (64 f32 rows of 576 are 144 KiB).
const ROW_TILE: usize = 64;

/// The thread pool every product runs on (RAYON_NUM_THREADS threads, default one per core). Callers run whole
/// forward passes inside it (`pool().install`), so each parallel product is a work-stealing join between pool
/// threads rather than a sleep and wake-up of the calling thread (which cost a third of decode time).
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("frspec-{i}")).build().expect("thread pool"))
}

/// Buffers `Matrix::matmul` reuses so the decode loop does not allocate per token.
#[derive(Default)]
pub struct MatmulScratch {
    block_sums: Vec<f32>,
    transposed: Vec<f32>,
}

/// Which dot-product implementation this CPU runs. Chosen once per process, so results never mix the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 for dense rows, 16-lane AVX-512 for block-quantized rows (half the unpacking instructions).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    fn detect() -> Kernel {
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
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                kernels.push(Kernel::Avx512);
            }
        }
        kernels
    }
}

/// Dot product of two f32 slices, with the same arithmetic as a weight row of f32 storage.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dots_f32::<1>(Kernel::detect(), a, b, &[])[0]
}

/// Returns the AVX-512 or AVX2 version of a block kernel when the process runs one.
macro_rules! vectorized {
    ($kernel:expr, $f:ident($($arg:expr),*)) => {
        #[cfg(target_arch = "x86_64")]
        match $kernel {
            // SAFETY: Kernel::Avx512 is only chosen when the CPU reports avx512f and avx512bw besides avx2, fma and
            // f16c, Kernel::Avx2 when it reports avx2, fma and f16c (`Kernel::available`).
            Kernel::Avx512 => return unsafe { avx512::$f::<N>($($arg),*) },
            Kernel::Avx2 => return unsafe { avx2::$f::<N>($($arg),*) },
            Kernel::Scalar => {}
        }
    };
}

// Each `dots_*::<N>` computes N dot products of one weight row with N consecutive activation rows of `x`.
// Output j depends only on the row and x[j], through the same operations for every N.

fn dots_f32<const N: usize>(kernel: Kernel, w: &[f32], x: &[f32], _: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: these kernels are only chosen when the CPU reports avx2, fma and f16c.
        return unsafe { avx2::dots_f32::<N>(w, x) };
    }
    let _ = kernel;
    std::array::from_fn(|j| scalar_lanes(w.len(), |i| w[i] * x[j * w.len() + i]))
}

fn dots_f16<const N: usize>(kernel: Kernel, w: &[f16], x: &[f32], _: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: as above.
        return unsafe { avx2::dots_f16::<N>(w, x) };
    }
    let _ = kernel;
    std::array::from_fn(|j| scalar_lanes(w.len(), |i| w[i].to_f32() * x[j * w.len() + i]))
}

fn dots_q4_0<const N: usize>(kernel: Kernel, w: &[BlockQ4_0], x: &[f32], _: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_q4_0(w, x));
    let _ = kernel;
    let cols = w.len() * QK;
    std::array::from_fn(|j| {
        w.iter()
            .zip(x[j * cols..(j + 1) * cols].chunks_exact(QK))
            .map(|(b, xs)| {
                let s: f32 = (0..QK / 2)
                    .map(|i| ((b.qs[i] & 0x0f) as f32 - 8.0) * xs[i] + ((b.qs[i] >> 4) as f32 - 8.0) * xs[i + QK / 2])
                    .sum();
                b.d.to_f32() * s
            })
            .sum()
    })
}

fn dots_q4_1<const N: usize>(kernel: Kernel, w: &[BlockQ4_1], x: &[f32], block_sums: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_q4_1(w, x, block_sums));
    let _ = kernel;
    let cols = w.len() * QK;
    // Σ (d q + m) x = d Σ q x + m Σ x, with Σ x per block computed once per activation row.
    std::array::from_fn(|j| {
        w.iter()
            .zip(x[j * cols..(j + 1) * cols].chunks_exact(QK))
            .zip(&block_sums[j * w.len()..(j + 1) * w.len()])
            .map(|((b, xs), s)| {
                let qx: f32 =
                    (0..QK / 2).map(|i| (b.qs[i] & 0x0f) as f32 * xs[i] + (b.qs[i] >> 4) as f32 * xs[i + QK / 2]).sum();
                b.d.to_f32() * qx + b.m.to_f32() * s
            })
            .sum()
    })
}

fn dots_q8_0<const N: usize>(kernel: Kernel, w: &[BlockQ8_0], x: &[f32], _: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_q8_0(w, x));
    let _ = kernel;
    let cols = w.len() * QK;
    std::array::from_fn(|j| {
        w.iter()
            .zip(x[j * cols..(j + 1) * cols].chunks_exact(QK))
            .map(|(b, xs)| b.d.to_f32() * b.qs.iter().zip(xs).map(|(q, x)| *q as f32 * x).sum::<f32>())
            .sum()
    })
}

/// A K-quant super-block with its vector unpacking where the architecture has one.
#[cfg(target_arch = "x86_64")]
trait KBlock: avx2::Unpack {}
#[cfg(target_arch = "x86_64")]
impl<B: avx2::Unpack> KBlock for B {}
#[cfg(not(target_arch = "x86_64"))]
trait KBlock: SuperBlock {}
#[cfg(not(target_arch = "x86_64"))]
impl<B: SuperBlock> KBlock for B {}

/// K-quant rows: per sub-block of 32, scale · Σ v x + offset · Σ x (Σ x from `block_sums`, computed once per
/// activation row, as for Q4_1).
fn dots_k<const N: usize>(kernel: Kernel, w: &[impl KBlock], x: &[f32], block_sums: &[f32]) -> [f32; N] {
    vectorized!(kernel, dots_k(w, x, block_sums));
    let _ = kernel;
    let (cols, subs) = (w.len() * QK_K, w.len() * SUBS);
    std::array::from_fn(|j| {
        (0..subs)
            .map(|i| {
                let (v, scale, offset) = w[i / SUBS].sub_block(i % SUBS);
                let xs = &x[j * cols + i * QK..j * cols + (i + 1) * QK];
                let vx: f32 = v.iter().zip(xs).map(|(v, x)| v * x).sum();
                let sum = if offset != 0.0 { offset * block_sums[j * subs + i] } else { 0.0 };
                scale * vx + sum
            })
            .sum()
    })
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
    use super::kquants::scale_min;
    use super::{BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ6K, BlockQ8_0, SuperBlock, QK, SUBS};
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

    /// Plain rows: two accumulators per activation row over 16-element steps, then a scalar tail.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_dense<const N: usize>(n: usize, x: &[f32], load: impl Fn(usize) -> __m256, at: impl Fn(usize) -> f32) -> [f32; N] {
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut i = 0;
        while i + 16 <= n {
            let w0 = load(i);
            let w1 = load(i + 8);
            for (j, a) in acc.iter_mut().enumerate() {
                let xp = x.as_ptr().add(j * n + i);
                a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), a[0]);
                a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(8)), a[1]);
            }
            i += 16;
        }
        std::array::from_fn(|j| {
            let mut s = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
            for t in i..n {
                s += at(t) * x[j * n + t];
            }
            s
        })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_f32<const N: usize>(w: &[f32], x: &[f32]) -> [f32; N] {
        dots_dense::<N>(w.len(), x, |i| _mm256_loadu_ps(w.as_ptr().add(i)), |i| w[i])
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_f16<const N: usize>(w: &[f16], x: &[f32]) -> [f32; N] {
        dots_dense::<N>(
            w.len(),
            x,
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

    /// The 32 signed bytes of a Q8_0 block as four vectors of 8 f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bytes(qs: &[i8; QK]) -> [__m256; 4] {
        let p = qs.as_ptr();
        std::array::from_fn(|k| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * k) as *const __m128i))))
    }

    /// Σ q_i x_i over one block, q given as four 8-lane vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_qx(q: &[__m256; 4], x: *const f32) -> __m256 {
        let p = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
        let p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x.add(8)), p);
        let p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x.add(16)), p);
        _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x.add(24)), p)
    }

    /// Block-quantized rows: `unpack` gives a block's values as 4×8 f32, its scale and its offset; per
    /// activation row j, acc_j += scale · Σ q x and off_j += offset · Σ x (`block_sums`, Q4_1 only).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_blocks<const N: usize>(
        nb: usize,
        x: &[f32],
        block_sums: &[f32],
        unpack: impl Fn(usize) -> ([__m256; 4], f32, f32),
    ) -> [f32; N] {
        let cols = nb * QK;
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [0f32; N];
        for i in 0..nb {
            let (q, d, m) = unpack(i);
            let d = _mm256_set1_ps(d);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(d, block_qx(&q, x.as_ptr().add(j * cols + i * QK)), *a);
            }
            if !block_sums.is_empty() {
                for (j, o) in off.iter_mut().enumerate() {
                    *o += m * block_sums.get_unchecked(j * nb + i);
                }
            }
        }
        std::array::from_fn(|j| hsum(acc[j]) + off[j])
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_q4_0<const N: usize>(w: &[BlockQ4_0], x: &[f32]) -> [f32; N] {
        let eight = _mm256_set1_ps(8.0);
        dots_blocks::<N>(w.len(), x, &[], |i| (nibbles(&w[i].qs).map(|v| _mm256_sub_ps(v, eight)), to_f32(w[i].d), 0.0))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_q4_1<const N: usize>(w: &[BlockQ4_1], x: &[f32], block_sums: &[f32]) -> [f32; N] {
        dots_blocks::<N>(w.len(), x, block_sums, |i| (nibbles(&w[i].qs), to_f32(w[i].d), to_f32(w[i].m)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_q8_0<const N: usize>(w: &[BlockQ8_0], x: &[f32]) -> [f32; N] {
        dots_blocks::<N>(w.len(), x, &[], |i| (bytes(&w[i].qs), to_f32(w[i].d), 0.0))
    }

    /// K-quant sub-blocks unpacked with vector instructions (the same values `SuperBlock::sub_block` gives), then
    /// multiplied as any other block of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_k<const N: usize>(w: &[impl Unpack], x: &[f32], block_sums: &[f32]) -> [f32; N] {
        dots_blocks::<N>(w.len() * SUBS, x, block_sums, |i| w[i / SUBS].unpack(i % SUBS))
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
    use super::avx2::Unpack;
    use super::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK, SUBS};
    use half::f16;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn to_f32(h: f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
    }

    /// The 32 nibbles of a block as two vectors of 16 f32 (low nibbles are elements 0..16).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn nibbles(qs: &[u8; QK / 2]) -> [__m512; 2] {
        let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        [_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))]
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn bytes(qs: &[i8; QK]) -> [__m512; 2] {
        let p = qs.as_ptr() as *const __m128i;
        [_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(1))))]
    }

    /// Block-quantized rows, as `avx2::dots_blocks` with 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn dots_blocks<const N: usize>(
        nb: usize,
        x: &[f32],
        block_sums: &[f32],
        unpack: impl Fn(usize) -> ([__m512; 2], f32, f32),
    ) -> [f32; N] {
        let cols = nb * QK;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut off = [0f32; N];
        for i in 0..nb {
            let (q, d, m) = unpack(i);
            let d = _mm512_set1_ps(d);
            for (j, a) in acc.iter_mut().enumerate() {
                let xp = x.as_ptr().add(j * cols + i * QK);
                let p = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xp.add(16)), _mm512_mul_ps(q[0], _mm512_loadu_ps(xp)));
                *a = _mm512_fmadd_ps(d, p, *a);
            }
            if !block_sums.is_empty() {
                for (j, o) in off.iter_mut().enumerate() {
                    *o += m * block_sums.get_unchecked(j * nb + i);
                }
            }
        }
        std::array::from_fn(|j| _mm512_reduce_add_ps(acc[j]) + off[j])
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_q4_0<const N: usize>(w: &[BlockQ4_0], x: &[f32]) -> [f32; N] {
        let eight = _mm512_set1_ps(8.0);
        dots_blocks::<N>(w.len(), x, &[], |i| (nibbles(&w[i].qs).map(|v| _mm512_sub_ps(v, eight)), to_f32(w[i].d), 0.0))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_q4_1<const N: usize>(w: &[BlockQ4_1], x: &[f32], block_sums: &[f32]) -> [f32; N] {
        dots_blocks::<N>(w.len(), x, block_sums, |i| (nibbles(&w[i].qs), to_f32(w[i].d), to_f32(w[i].m)))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_q8_0<const N: usize>(w: &[BlockQ8_0], x: &[f32]) -> [f32; N] {
        dots_blocks::<N>(w.len(), x, &[], |i| (bytes(&w[i].qs), to_f32(w[i].d), 0.0))
    }

    /// The AVX2 unpacking, its four 8-lane vectors joined in pairs.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn dots_k<const N: usize>(w: &[impl Unpack], x: &[f32], block_sums: &[f32]) -> [f32; N] {
        let join = |a: __m256, b: __m256| _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
        dots_blocks::<N>(w.len() * SUBS, x, block_sums, |i| {
            let (v, scale, offset) = w[i / SUBS].unpack(i % SUBS);
            ([join(v[0], v[1]), join(v[2], v[3])], scale, offset)
        })
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
        let w = dense(m);
        let n = m.rows * m.cols / QK;
        let q8 = (0..n).map(|_| BlockQ8_0 { d: f16::from_f32(rng.random_range(0.001..0.02)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        let q4 = (0..n).map(|_| BlockQ4_0 { d: f16::from_f32(rng.random_range(0.001..0.05)), qs: std::array::from_fn(|_| rng.random()) }).collect();
        vec![
            m.clone(),
            Matrix { storage: Storage::Q8_0(q8), ..m.clone() },
            Matrix { storage: Storage::Q4_0(q4), ..m.clone() },
            Matrix { storage: Storage::F16(w.iter().map(|v| f16::from_f32(*v)).collect()), ..m.clone() },
            Matrix { storage: Storage::F32(w), ..m.clone() },
        ]
    }

    #[test]
    fn every_kernel_matches_the_dequantized_reference_and_a_block_equals_its_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // 9 rows of activations: more than one group of GROUP = 8.
        let (rows, cols, n) = (70, 96, 9);
        let q41 = random_q4_1(rows, cols, &mut rng);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        for m in all_storages(&q41, &mut rng) {
            kernels_agree(&m, &dense(&m), &x, |_| 1e-4);
        }
    }

    /// Every kernel's product of `m` with each row of `x`: a block of rows equals the rows one by one, bit for bit,
    /// and each value lies within `tolerance(Σ |w x|)` of the exact product of `reference` (m's values).
    fn kernels_agree(m: &Matrix, reference: &[f32], x: &[f32], tolerance: impl Fn(f64) -> f64) {
        let (rows, cols) = (m.rows, m.cols);
        let n = x.len() / cols;
        let mut scratch = MatmulScratch::default();
        for kernel in Kernel::available() {
            let mut block = vec![0.0; n * rows];
            m.matmul_with(kernel, x, &mut block, &mut scratch);
            for b in 0..n {
                let xb = &x[b * cols..(b + 1) * cols];
                let mut single = vec![0.0; rows];
                m.matmul_with(kernel, xb, &mut single, &mut scratch);
                assert_eq!(&block[b * rows..(b + 1) * rows], &single[..], "{} {kernel:?}: block row {b} differs", m.dtype_name());
                for r in 0..rows {
                    let terms = || (0..cols).map(|c| reference[r * cols + c] as f64 * xb[c] as f64);
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
            kernels_agree(&m, &reference, &x, |scale| 1e-5 * scale);
            // The sliced head keeps K-quant rows as they are.
            let picked = m.select_rows(&[3, 17]);
            assert_eq!(dense(&picked), [&ours[3 * cols..4 * cols], &ours[17 * cols..18 * cols]].concat());
        }
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
}
