//! Activations quantized to 8 bits per run of 32 values, and their integer products with Q4_0, Q4_1 and Q8_0 rows
//! (`Activations::Q8`), as llama.cpp multiplies these types (its Q8_0 / Q8_1 activations).
//!
//! Why: with f32 activations every activation row costs two 16-lane multiply-adds per block of 32 weights (the FMA
//! peak), so a verification block of 5 rows cost 1.96× one row and 8 such blocks together about what they cost apart
//! (results/bench/f32-kernels-2026-12-01.md). Here one `vpdpbusd` (AVX-512 VNNI) multiplies four values of 16 weight
//! rows by four of an activation row, exact in integers, and the conversion and scaling are paid once a block for 16
//! rows (results/bench/q8-activations-2026-12-02.md: ≈ 2× the f32 path's speed for 5 to 40 rows); without VNNI, AVX2
//! does the same for 8 rows with byte and word multiply-adds (results/bench/q8-default-2026-12-02.md: ≈ 2× AVX2's
//! f32 path). This is the default mode.
//!
//! Each activation row is quantized on its own and its products take the same operations whatever rows run beside
//! it, so a block of rows still equals its rows one by one, bit for bit (greedy losslessness does not depend on
//! the activations' precision, only on that).

use super::tensor::{nibble, pool, BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use half::f16;
use rayon::prelude::*;

/// Quantizes one run of values (a multiple of 32 long) to `qs` with d = max |x| / 127 and q = round(x · 127 / max |x|),
/// ties to even; returns d (0 for a run of zeros, whose q are 0). The vector versions give the same bits.
pub fn quantize_run(xs: &[f32], qs: &mut [i8]) -> f32 {
    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let iscale = 127.0 / amax;
    for (q, v) in qs.iter_mut().zip(xs) {
        *q = (v * iscale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

/// Activation rows quantized per block of 32 (`quantize_run`), as the integer kernels read them. The buffers keep
/// the length of the most rows quantized so far and the first `blocks` blocks are this product's: emptied and
/// filled again for every product, they were zeroed first each time (8 MB a forward for a batch of 16 SmolLM2
/// verification blocks), and a batch's and a draft's products alternate between row counts.
#[derive(Default)]
pub struct Q8Rows {
    /// `[rows, cols]` quantized values.
    qs: Vec<i8>,
    /// Each block's d.
    d: Vec<f32>,
    /// Each block's d · Σq, what the weights' offsets meet.
    sums: Vec<f32>,
    blocks: usize,
}

impl Q8Rows {
    pub fn clear(&mut self) {
        self.blocks = 0;
    }

    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// The rows of `x` (each `cols` long, a multiple of 32), quantized by `quantize` (`quantize_run` or a vector
    /// version of it), in place of any before. Many rows (a batch of verification blocks) are quantized on the pool,
    /// a group of blocks a task: on one core they kept the other waiting for the product that follows.
    pub fn quantize(&mut self, x: &[f32], quantize: impl Fn(&[f32], &mut [i8]) -> f32 + Sync) {
        const GROUP: usize = 128;
        let blocks = x.len() / QK;
        if self.d.len() < blocks {
            self.qs.resize(blocks * QK, 0);
            self.d.resize(blocks, 0.0);
            self.sums.resize(blocks, 0.0);
        }
        self.blocks = blocks;
        let (qs, d, sums) = (&mut self.qs[..blocks * QK], &mut self.d[..blocks], &mut self.sums[..blocks]);
        let group = |(((x, qs), d), sums): (((&[f32], &mut [i8]), &mut [f32]), &mut [f32])| {
            for (((xs, qs), d), sum) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).zip(d).zip(sums) {
                *d = quantize(xs, qs);
                *sum = *d * qs.iter().map(|&q| q as i32).sum::<i32>() as f32;
            }
        };
        match blocks < 2 * GROUP {
            true => group((((x, qs), d), sums)),
            false => pool().install(|| {
                let groups = x.par_chunks(GROUP * QK).zip(qs.par_chunks_mut(GROUP * QK)).zip(d.par_chunks_mut(GROUP));
                groups.zip(sums.par_chunks_mut(GROUP)).for_each(group)
            }),
        }
    }

    /// Activation rows `rows` (of `nb` blocks each).
    pub fn rows(&self, rows: std::ops::Range<usize>, nb: usize) -> Q8View<'_> {
        debug_assert!(rows.end * nb <= self.blocks);
        Q8View {
            qs: &self.qs[rows.start * nb * QK..rows.end * nb * QK],
            d: &self.d[rows.start * nb..rows.end * nb],
            sums: &self.sums[rows.start * nb..rows.end * nb],
        }
    }
}

/// Some rows of `Q8Rows`.
#[derive(Clone, Copy)]
pub struct Q8View<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [f32],
}

/// A block of 32 weights as the integer products read it: value l is `d · q(l) + offset` with q unsigned (a byte):
/// Q4_1's nibble and m, Q4_0's nibble and −8d, Q8_0's q + 128 and −128d (the offsets are exact in f32).
pub trait IntBlock: Copy + Send + Sync {
    /// The offset as a multiple of d, for the types whose offset follows from d (the vector kernel uses it too).
    const OFFSET_TIMES_D: f32 = 0.0;
    fn d(&self) -> f32;
    fn offset(&self) -> f32 {
        Self::OFFSET_TIMES_D * self.d()
    }
    fn q(&self, l: usize) -> i32;
}

impl IntBlock for BlockQ4_0 {
    const OFFSET_TIMES_D: f32 = -8.0;
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn q(&self, l: usize) -> i32 {
        nibble(&self.qs, l) as i32
    }
}

impl IntBlock for BlockQ4_1 {
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    /// Its own m.
    fn offset(&self) -> f32 {
        self.m.to_f32()
    }
    fn q(&self, l: usize) -> i32 {
        nibble(&self.qs, l) as i32
    }
}

impl IntBlock for BlockQ8_0 {
    const OFFSET_TIMES_D: f32 = -128.0;
    fn d(&self) -> f32 {
        self.d.to_f32()
    }
    fn q(&self, l: usize) -> i32 {
        self.qs[l] as i32 + 128
    }
}

/// One weight row times activation row `j` of `a`, the arithmetic every kernel follows (so all give these bits):
/// per block in order, the exact integer sum S = Σ q·qa, then acc ← S · (d · da) + acc and acc ← offset · (da · Σqa)
/// + acc, each one fused multiply-add.
pub fn dot_row<B: IntBlock>(row: &[B], a: &Q8View, j: usize) -> f32 {
    let nb = row.len();
    let mut acc = 0f32;
    for (b, w) in row.iter().enumerate() {
        let qa = &a.qs[(j * nb + b) * QK..][..QK];
        let s: i32 = (0..QK).map(|l| w.q(l) * qa[l] as i32).sum();
        acc = (s as f32).mul_add(w.d() * a.d[j * nb + b], acc);
        acc = w.offset().mul_add(a.sums[j * nb + b], acc);
    }
    acc
}

/// Weight rows `w` (whole rows of `nb` blocks) times N activation rows of `a`: row r's product with activation row
/// j goes to `out[j · stride + r]`.
pub fn dots_rows_scalar<const N: usize, B: IntBlock>(w: &[B], nb: usize, a: &Q8View, out: &mut [f32], stride: usize) {
    for (r, row) in w.chunks_exact(nb).enumerate() {
        for j in 0..N {
            out[j * stride + r] = dot_row(row, a, j);
        }
    }
}

/// Q8_0 or Q4_1 rows laid out for `avx512::dots_interleaved`, in groups of 16 rows (one per lane): for each block, the
/// 16 rows' values as 64-byte vectors (vector t holds the bytes 4t .. 4t + 4 that the kernel multiplies of the group's
/// row r in bytes 4r .. 4r + 4: Q8_0's values as the unsigned q + 128 that `vpdpbusd` takes, eight vectors; Q4_1's
/// nibble bytes, four), then, after the group's blocks, their scales (16 f16 d a block, Q4_1's 16 m after them). Why:
/// in the GGUF layout (each row's blocks in a run) the kernel brought every block's bytes into lanes with 16 loads and
/// a transpose, about a fifth of its instructions, and read 16 rows' streams side by side; here a group of rows is one
/// stream of aligned vectors, and the same bytes as before (`results/bench/interleaved-q8-2026-12-06.md`: SmolLM2's
/// Q8_0 LM head at one activation row 1.5× as fast, FR-Spec's sliced heads 2.0–2.3×, 1.15–1.23× at 16 and 80 rows; one
/// sequence's decode ≈ 1.2× with the Q4_1 layers too; no gain where the weights' bytes set the time). Built
/// at load where the AVX-512 VNNI kernel will meet 8-bit activations (`Storage::q8_0`, `Storage::q4_1`); the other
/// kernels read blocks back in the GGUF layout (`block`).
#[derive(Clone)]
pub struct Interleaved<B> {
    rows: usize,
    nb: usize,
    vectors: Vec<Vector>,
    block_type: std::marker::PhantomData<B>,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Vector([u8; 64]);

/// Rows a group of `Interleaved` holds: the 16 lanes of an AVX-512 vector of i32 sums.
pub const LANES: usize = 16;

/// A block type `Interleaved` lays out: its bytes as the kernel reads them, and back.
pub trait Interleave: IntBlock {
    /// 64-byte vectors of values a block of 16 rows takes (4 bytes of each row a vector).
    const VALUE_VECTORS: usize;
    /// Bytes of scales a block of 16 rows takes: d, then Q4_1's m (16 f16 each).
    const SCALE_BYTES: usize;
    /// The 4 bytes of value vector t, and the scales' bits.
    fn word(&self, t: usize) -> [u8; 4];
    fn scales(&self) -> [u16; 2];
    /// The block of these words and scales.
    fn from_parts(word: impl Fn(usize) -> [u8; 4], scales: [u16; 2]) -> Self;
}

impl Interleave for BlockQ8_0 {
    const VALUE_VECTORS: usize = 8;
    const SCALE_BYTES: usize = 32;
    fn word(&self, t: usize) -> [u8; 4] {
        std::array::from_fn(|k| self.qs[4 * t + k] as u8 ^ 0x80)
    }
    fn scales(&self) -> [u16; 2] {
        [self.d.to_bits(), 0]
    }
    fn from_parts(word: impl Fn(usize) -> [u8; 4], [d, _]: [u16; 2]) -> Self {
        BlockQ8_0 { d: f16::from_bits(d), qs: std::array::from_fn(|l| (word(l / 4)[l % 4] ^ 0x80) as i8) }
    }
}

impl Interleave for BlockQ4_1 {
    const VALUE_VECTORS: usize = 4;
    const SCALE_BYTES: usize = 64;
    fn word(&self, t: usize) -> [u8; 4] {
        std::array::from_fn(|k| self.qs[4 * t + k])
    }
    fn scales(&self) -> [u16; 2] {
        [self.d.to_bits(), self.m.to_bits()]
    }
    fn from_parts(word: impl Fn(usize) -> [u8; 4], [d, m]: [u16; 2]) -> Self {
        BlockQ4_1 { d: f16::from_bits(d), m: f16::from_bits(m), qs: std::array::from_fn(|l| word(l / 4)[l % 4]) }
    }
}

impl<B: Interleave> Interleaved<B> {
    /// `blocks`: whole rows of `nb` blocks, row-major. Lanes past the last row hold zeros (never stored).
    pub fn new(blocks: &[B], nb: usize) -> Interleaved<B> {
        let rows = blocks.len() / nb;
        let per_group = Interleaved::<B>::group_vectors(nb);
        let mut vectors = vec![Vector([0; 64]); rows.div_ceil(LANES) * per_group];
        for (r, row) in blocks.chunks_exact(nb).enumerate() {
            let (group, lane) = (&mut vectors[r / LANES * per_group..][..per_group], r % LANES);
            for (b, block) in row.iter().enumerate() {
                for t in 0..B::VALUE_VECTORS {
                    group[b * B::VALUE_VECTORS + t].0[4 * lane..][..4].copy_from_slice(&block.word(t));
                }
                for (i, bits) in block.scales().into_iter().enumerate().take(B::SCALE_BYTES / 32) {
                    let at = Interleaved::<B>::scale_at(nb, b) + 32 * i + 2 * lane;
                    group[at / 64].0[at % 64..][..2].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
        Interleaved { rows, nb, vectors, block_type: std::marker::PhantomData }
    }

    /// Vectors of one group: the blocks' values, then their scales.
    fn group_vectors(nb: usize) -> usize {
        nb * B::VALUE_VECTORS + (nb * B::SCALE_BYTES).div_ceil(64)
    }

    /// Where block b's scales start in its group, in bytes.
    fn scale_at(nb: usize, b: usize) -> usize {
        nb * B::VALUE_VECTORS * 64 + b * B::SCALE_BYTES
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks of 32 values a row holds.
    pub fn row_blocks(&self) -> usize {
        self.nb
    }

    /// Block `b` of row `r` in its GGUF layout.
    pub fn block(&self, r: usize, b: usize) -> B {
        let (group, lane) = (&self.vectors[r / LANES * Interleaved::<B>::group_vectors(self.nb)..], r % LANES);
        let byte = |at: usize| group[at / 64].0[at % 64];
        let scale = |i: usize| {
            let at = Interleaved::<B>::scale_at(self.nb, b) + 32 * i + 2 * lane;
            u16::from_le_bytes([byte(at), byte(at + 1)])
        };
        let scales = [scale(0), if B::SCALE_BYTES > 32 { scale(1) } else { 0 }];
        B::from_parts(|t| std::array::from_fn(|k| byte((b * B::VALUE_VECTORS + t) * 64 + 4 * lane + k)), scales)
    }

    /// Rows `rows` in the GGUF layout.
    pub fn blocks(&self, rows: std::ops::Range<usize>) -> Vec<B> {
        rows.flat_map(|r| (0..self.nb).map(move |b| self.block(r, b))).collect()
    }

    /// The rows `ids`, in that order.
    pub fn select_rows(&self, ids: &[u32]) -> Interleaved<B> {
        let blocks: Vec<B> = ids.iter().flat_map(|&r| (0..self.nb).map(move |b| self.block(r as usize, b))).collect();
        Interleaved::new(&blocks, self.nb)
    }

    pub fn bytes(&self) -> usize {
        self.vectors.len() * std::mem::size_of::<Vector>()
    }
}

/// Blocks ahead of the one being multiplied that `prefetch_ahead` asks for (2 and 8 were slower).
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 4;

/// Asks for block `b + PREFETCH_AHEAD` of each of a kernel's rows (`rows[r]`: a group of consecutive rows of `nb`
/// blocks of `size` bytes) while block b is multiplied; past a row's end, for the same blocks of the group that follows
/// (the next rows in memory, which the kernel multiplies next). A kernel reads its 8 or 16 rows side by side, a block
/// of each at a time: as many streams, each a few hundred bytes long (18 blocks at SmolLM2's 576 columns), and a decode
/// step's weights come from memory (a SmolLM2 forward reads 97 MB of Q4_1 and Q8_0 weights, three times a Zen 4's L3):
/// without asking, the AVX-512 kernel took 9–12 ms for SmolLM2's LM head at 16 activation rows, 5.5 ms with
/// (`results/bench/prefetch-2026-12-06.md`). Only for a tile's first group of activation rows: the groups after it find
/// the tile in cache, and asking again only cost instructions (≈ 8% slower at 1,024 activation rows). Prefetches never
/// fault, so the addresses past the matrix's end need no care.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_ahead(rows: &[*const u8], b: usize, nb: usize, size: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = b + PREFETCH_AHEAD;
    let offset = if ahead < nb { ahead * size } else { (rows.len() * nb + ahead - nb) * size };
    for r in rows {
        _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(offset) as *const i8);
    }
}

/// How a block type's bytes are laid out, for gathering the same block of several rows into vectors.
#[cfg(target_arch = "x86_64")]
pub trait VectorBlock: IntBlock {
    /// Where the 16-bit d is (Q4_1's m follows it).
    const HEADER: usize = 0;
    /// Where the values start.
    const VALUES: usize;
    /// Whether values are nibbles (element l < 16 low, l ≥ 16 high, of byte l % 16), else signed bytes.
    const NIBBLES: bool;
    /// Whether the offset is the f16 after d (Q4_1), else `IntBlock::OFFSET_TIMES_D` · d.
    const OWN_OFFSET: bool = false;
}

#[cfg(target_arch = "x86_64")]
impl VectorBlock for BlockQ4_0 {
    const VALUES: usize = 2;
    const NIBBLES: bool = true;
}

#[cfg(target_arch = "x86_64")]
impl VectorBlock for BlockQ4_1 {
    const VALUES: usize = 4;
    const NIBBLES: bool = true;
    const OWN_OFFSET: bool = true;
}

#[cfg(target_arch = "x86_64")]
impl VectorBlock for BlockQ8_0 {
    const VALUES: usize = 2;
    const NIBBLES: bool = false;
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::{prefetch_ahead, Interleave, Interleaved, Q8View, VectorBlock, LANES, QK};
    use std::arch::x86_64::*;

    /// One block (`b` of `nb`) of 16 weight rows (`values`: its unsigned bytes in lanes, `d` and `offset` each row's)
    /// times activation rows 0 .. N of `a`, added to `acc`: the exact sums by `vpdpbusd`, then `dot_row`'s two
    /// multiply-adds. A macro, not a function: as an `#[inline]` function with the kernels' target features LLVM kept
    /// it out of line (a profile of answering showed a call a block, each instance its own symbol). Activation row j's
    /// part is written out for each j < N: as a loop over j, LLVM unrolled it up to 8 rows, and from 9 on kept the loop
    /// with `acc` on the stack, a load and a store around every multiply-add; with constant indices the sums stay in
    /// registers.
    macro_rules! block_products {
        ($values:expr, $d:expr, $offset:expr, $a:expr, $nb:expr, $b:expr, $acc:expr, $n:ident) => {
            block_products!(@rows $values, $d, $offset, $a, $nb, $b, $acc, $n, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
        };
        (@rows $values:expr, $d:expr, $offset:expr, $a:expr, $nb:expr, $b:expr, $acc:expr, $n:ident, $($j:literal)*) => {{
            const { assert!($n <= 16, "block_products writes out 16 activation rows") };
            let (values, d, offset, a, nb, b, acc): (&[__m512i; 8], __m512, __m512, &Q8View, usize, usize, &mut [__m512; $n]) = ($values, $d, $offset, $a, $nb, $b, $acc);
            $(
                if $j < $n {
                    let qa = a.qs.as_ptr().add(($j * nb + b) * QK) as *const i32;
                    let mut s = _mm512_setzero_si512();
                    for (t, v) in values.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, *v, _mm512_set1_epi32(std::ptr::read_unaligned(qa.add(t))));
                    }
                    let scale = _mm512_mul_ps(d, _mm512_set1_ps(*a.d.get_unchecked($j * nb + b)));
                    acc[$j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[$j]);
                    acc[$j] = _mm512_fmadd_ps(offset, _mm512_set1_ps(*a.sums.get_unchecked($j * nb + b)), acc[$j]);
                }
            )*
        }};
    }

    /// Weight rows times N activation rows, as `dots_rows_scalar` and to its bits: 16 weight rows at a time, one
    /// per lane. For each block, four bytes of each row are brought into one vector (the same four values of 16
    /// rows), and `vpdpbusd` multiplies them by the same four activation values broadcast: 8 instructions give a
    /// block's exact sums for 16 rows (with per-row products, one instruction covered 64 products and every one
    /// needed its own conversion and scaling). The last rows fill fewer lanes (masked), with the same arithmetic.
    /// The bytes reach their lanes through 16-byte loads and a transpose (`words`), as in the AVX2 kernel, not
    /// through `vpgatherdd`: on a Zen 4 the five gathers a block made the head's product at one activation row
    /// 4× slower (`results/bench/cpu-main-job-batch-2026-12-05.md`). `cold`: the rows come from memory, not
    /// cache (`prefetch_ahead`).
    ///
    /// # Safety
    /// On a CPU with avx512f, avx512bw, avx512vl, avx512vnni, avx2, fma and f16c; `w` is whole rows of `nb` blocks,
    /// `a` holds N rows of `nb` blocks and `out` reaches `(N − 1) · stride + rows`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots_rows<const N: usize, B: VectorBlock>(w: &[B], nb: usize, a: &Q8View, cold: bool, out: &mut [f32], stride: usize) {
        let rows = w.len() / nb;
        let size = std::mem::size_of::<B>();
        let (low4, flip) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(-128));
        let zero = _mm512_setzero_si512();
        for first in (0..rows).step_by(16) {
            let lanes = (rows - first).min(16);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
            // Lanes past the last row read the last row again; they are not stored.
            let row = |r: usize| w.as_ptr().add((first + r.min(lanes - 1)) * nb) as *const u8;
            let group: [*const u8; 16] = std::array::from_fn(row);
            let mut acc = [_mm512_setzero_ps(); N];
            for b in 0..nb {
                let at = b * size;
                if cold {
                    prefetch_ahead(&group, b, nb, size);
                }
                // Every block type is at least 16 bytes from its header and from its values on.
                let header = words(&group, at + B::HEADER)[0];
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
                let offset = if B::OWN_OFFSET {
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(header)))
                } else {
                    _mm512_mul_ps(d, _mm512_set1_ps(B::OFFSET_TIMES_D))
                };
                // values[t]: elements 4t .. 4t + 4 of each row's block, as unsigned bytes.
                let mut values = [zero; 8];
                if B::NIBBLES {
                    for (u, v) in words(&group, at + B::VALUES).into_iter().enumerate() {
                        values[u] = _mm512_and_si512(v, low4);
                        values[u + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                    }
                } else {
                    let (low, high) = (words(&group, at + B::VALUES), words(&group, at + B::VALUES + 16));
                    for (v, word) in values.iter_mut().zip(low.into_iter().chain(high)) {
                        *v = _mm512_xor_si512(word, flip);
                    }
                }
                block_products!(&values, d, offset, a, nb, b, &mut acc, N);
            }
            // An activation row's products of the 16 weight rows are neighbours in `out`: one masked store.
            for (j, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(j * stride + first), mask, *acc);
            }
        }
    }

    /// `dots_rows` for rows in `Interleaved`'s layout, to the same bits, over the matrix's rows `rows` (a range that
    /// may start and end inside a group: the lanes outside it are not stored).
    ///
    /// # Safety
    /// On a CPU with avx512f, avx512bw, avx512vl, avx512vnni, avx2, fma and f16c; `rows` within `w`'s, `a` holds N rows
    /// of `w`'s blocks and `out` reaches `(N − 1) · stride + rows.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dots_interleaved<const N: usize, B: Interleave + VectorBlock>(w: &Interleaved<B>, rows: std::ops::Range<usize>, a: &Q8View, cold: bool, out: &mut [f32], stride: usize) {
        let (nb, per_group) = (w.nb, Interleaved::<B>::group_vectors(w.nb));
        let (offset_times_d, low4) = (_mm512_set1_ps(B::OFFSET_TIMES_D), _mm512_set1_epi8(0x0f));
        for group in rows.start / LANES..rows.end.div_ceil(LANES) {
            let first = group * LANES;
            let (from, to) = (rows.start.max(first) - first, rows.end.min(first + LANES) - first);
            let mask = ((1u32 << to) - (1u32 << from)) as __mmask16;
            let vectors = w.vectors.as_ptr().add(group * per_group) as *const u8;
            let mut acc = [_mm512_setzero_ps(); N];
            for b in 0..nb {
                let block = vectors.add(b * B::VALUE_VECTORS * 64);
                if cold {
                    // One stream: the next blocks' vectors (past the group's values, its scales and the next group's).
                    let ahead = block.wrapping_add(super::PREFETCH_AHEAD * B::VALUE_VECTORS * 64);
                    for t in 0..B::VALUE_VECTORS {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(t * 64) as *const i8);
                    }
                }
                let scales = vectors.add(Interleaved::<B>::scale_at(nb, b));
                let d = _mm512_cvtph_ps(_mm256_load_si256(scales as *const __m256i));
                let offset = match B::OWN_OFFSET {
                    true => _mm512_cvtph_ps(_mm256_load_si256(scales.add(32) as *const __m256i)),
                    false => _mm512_mul_ps(d, offset_times_d),
                };
                let load = |t: usize| _mm512_load_si512(block.add(t * 64) as *const __m512i);
                let values: [__m512i; 8] = match B::NIBBLES {
                    true => std::array::from_fn(|t| match t < 4 {
                        true => _mm512_and_si512(load(t), low4),
                        false => _mm512_and_si512(_mm512_srli_epi16::<4>(load(t - 4)), low4),
                    }),
                    false => std::array::from_fn(load),
                };
                block_products!(&values, d, offset, a, nb, b, &mut acc, N);
            }
            // Lane r is row first + r, at out[j · stride + first + r − rows.start]: for a group that starts before
            // `rows`, an address before `out`'s start, in the lanes the mask leaves out.
            for (j, acc) in acc.iter().enumerate() {
                let lane_zero = out.as_mut_ptr().wrapping_add(j * stride + first).wrapping_sub(rows.start);
                _mm512_mask_storeu_ps(lane_zero, mask, *acc);
            }
        }
    }

    /// The four 32-bit words at byte `at` of each of 16 rows (`rows[r]` + `at`), transposed: word u of row r goes to
    /// lane r of the u-th vector, as `vpgatherdd` would place it.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn words(rows: &[*const u8; 16], at: usize) -> [__m512i; 4] {
        let load = |r: usize| _mm_loadu_si128(rows[r].add(at) as *const __m128i);
        // Rows r, r + 4, r + 8 and r + 12 share a vector: the 128-bit quarters transpose alike.
        let quarters = |r: usize| {
            let v = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(load(r)), load(r + 4));
            _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(v, load(r + 8)), load(r + 12))
        };
        let (y0, y1, y2, y3) = (quarters(0), quarters(1), quarters(2), quarters(3));
        let (t0, t1) = (_mm512_unpacklo_epi32(y0, y1), _mm512_unpackhi_epi32(y0, y1));
        let (t2, t3) = (_mm512_unpacklo_epi32(y2, y3), _mm512_unpackhi_epi32(y2, y3));
        [_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)]
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::{prefetch_ahead, Q8View, VectorBlock, QK};
    use std::arch::x86_64::*;

    /// `avx512::dots_rows` for CPUs without AVX-512 VNNI, to the same bits: 8 weight rows at a time, one per lane.
    /// Without `vpdpbusd` the same four bytes of 8 rows meet four activation bytes through `vpmaddubsw` (unsigned ×
    /// signed bytes into pairs of i16) and `vpmaddwd` (pairs into i32). A nibble pair is at most 2 · 15 · 127, so the 8
    /// pairs of a block sum in i16 before one `vpmaddwd`; Q8_0's unsigned bytes (up to 255) could overflow a pair, so
    /// each byte is split into its nibbles, summed as Q4's are, and the high nibbles' sum counts 16 times (two
    /// `vpmaddubsw` a word where Q4 has one: splitting into even and odd bytes for `vpmaddwd` cost twice the other
    /// instructions for the same number of multiplies). Either way each lane gets the block's exact sum, then the same
    /// conversion and multiply-adds as every other kernel. The 8 rows' bytes reach their lanes through 16-byte loads
    /// and a transpose (`words`), not gathers: AMD's Zen cores run `vpgatherdd` as microcode, and five gathers a block
    /// took ≈ 2/3 of a sampled sweep's time on a Zen 3.
    ///
    /// # Safety
    /// On a CPU with avx2, fma and f16c; `w` is whole rows of `nb` blocks, `a` holds N rows of `nb` blocks and `out`
    /// reaches `(N − 1) · stride + rows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_rows<const N: usize, B: VectorBlock>(w: &[B], nb: usize, a: &Q8View, cold: bool, out: &mut [f32], stride: usize) {
        let rows = w.len() / nb;
        let size = std::mem::size_of::<B>();
        let (low4, flip) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(-128));
        let zero = _mm256_setzero_si256();
        for first in (0..rows).step_by(8) {
            let lanes = (rows - first).min(8);
            // Lanes past the last row read the last row again; they are not stored.
            let row = |r: usize| w.as_ptr().add((first + r.min(lanes - 1)) * nb) as *const u8;
            let group = [row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7)];
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let at = b * size;
                if cold {
                    prefetch_ahead(&group, b, nb, size);
                }
                // Every block type is at least 16 bytes from its header and from its values on.
                let header = words(&group, at + B::HEADER)[0];
                let d = half_of(header, zero);
                let offset = if B::OWN_OFFSET {
                    half_of(_mm256_srli_epi32::<16>(header), zero)
                } else {
                    _mm256_mul_ps(d, _mm256_set1_ps(B::OFFSET_TIMES_D))
                };
                // values[t]: elements 4t .. 4t + 4 of each row's block, as unsigned bytes (Q8_0: their low nibbles,
                // and high_nibbles[t] the high ones).
                let (mut values, mut high_nibbles) = ([zero; 8], [zero; 8]);
                if B::NIBBLES {
                    for (u, v) in words(&group, at + B::VALUES).into_iter().enumerate() {
                        values[u] = _mm256_and_si256(v, low4);
                        values[u + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                    }
                } else {
                    let (low, high) = (words(&group, at + B::VALUES), words(&group, at + B::VALUES + 16));
                    for (t, v) in low.into_iter().chain(high).enumerate() {
                        let v = _mm256_xor_si256(v, flip);
                        values[t] = _mm256_and_si256(v, low4);
                        high_nibbles[t] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                    }
                }
                let qa = |j: usize| a.qs.as_ptr().add((j * nb + b) * QK);
                let finish = |acc: &mut __m256, j: usize, s: __m256i| {
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(j * nb + b)));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, *acc);
                    *acc = _mm256_fmadd_ps(offset, _mm256_set1_ps(*a.sums.get_unchecked(j * nb + b)), *acc);
                };
                for j in (0..N / 2).map(|p| 2 * p) {
                    let [first, second] = block_sums::<2, B>(&values, &high_nibbles, [qa(j), qa(j + 1)]);
                    finish(&mut acc[j], j, first);
                    finish(&mut acc[j + 1], j + 1, second);
                }
                if N % 2 == 1 {
                    let [last] = block_sums::<1, B>(&values, &high_nibbles, [qa(N - 1)]);
                    finish(&mut acc[N - 1], N - 1, last);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                let at = out.as_mut_ptr().add(j * stride + first);
                match lanes {
                    8 => _mm256_storeu_ps(at, *acc),
                    _ => {
                        let mut lanes_out = [0f32; 8];
                        _mm256_storeu_ps(lanes_out.as_mut_ptr(), *acc);
                        std::ptr::copy_nonoverlapping(lanes_out.as_ptr(), at, lanes);
                    }
                }
            }
        }
    }

    /// The exact sums of one block of 8 weight rows (`values`, and `high_nibbles` for Q8_0) with each of R
    /// activation blocks (`qa`): lane r of sum i is row r's. Two activation rows a call share each load of the
    /// weights: Q8_0's 16 vectors do not fit beside the sums in AVX2's 16 registers and are read from the stack.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_sums<const R: usize, B: VectorBlock>(values: &[__m256i; 8], high_nibbles: &[__m256i; 8], qa: [*const i8; R]) -> [__m256i; R] {
        let four = |i: usize, t: usize| _mm256_set1_epi32(std::ptr::read_unaligned(qa[i].add(4 * t) as *const i32));
        let (zero, ones) = (_mm256_setzero_si256(), _mm256_set1_epi16(1));
        let (mut low, mut high) = ([zero; R], [zero; R]);
        for t in 0..8 {
            for i in 0..R {
                let four = four(i, t);
                low[i] = _mm256_add_epi16(low[i], _mm256_maddubs_epi16(values[t], four));
                if !B::NIBBLES {
                    high[i] = _mm256_add_epi16(high[i], _mm256_maddubs_epi16(high_nibbles[t], four));
                }
            }
        }
        std::array::from_fn(|i| match B::NIBBLES {
            true => _mm256_madd_epi16(low[i], ones),
            false => _mm256_add_epi32(_mm256_madd_epi16(high[i], _mm256_set1_epi16(16)), _mm256_madd_epi16(low[i], ones)),
        })
    }

    /// The four 32-bit words at byte `at` of each of 8 rows (`rows[r]` + `at`), transposed: word u of row r goes to
    /// lane r of the u-th vector, as `vpgatherdd` would place it.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn words(rows: &[*const u8; 8], at: usize) -> [__m256i; 4] {
        let load = |r: usize| _mm_loadu_si128(rows[r].add(at) as *const __m128i);
        // Rows r and r + 4 share a vector: the 128-bit halves transpose alike.
        let (y0, y1, y2, y3) = (_mm256_set_m128i(load(4), load(0)), _mm256_set_m128i(load(5), load(1)), _mm256_set_m128i(load(6), load(2)), _mm256_set_m128i(load(7), load(3)));
        let (t0, t1) = (_mm256_unpacklo_epi32(y0, y1), _mm256_unpackhi_epi32(y0, y1));
        let (t2, t3) = (_mm256_unpacklo_epi32(y2, y3), _mm256_unpackhi_epi32(y2, y3));
        [_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)]
    }

    /// The f16 in the low half of each 32-bit lane, as f32. AVX2 has no 32-to-16-bit narrowing: the halves are
    /// packed (`vpackusdw`, exact for values below 2^16) and the two 128-bit lanes' results brought together.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half_of(v: __m256i, zero: __m256i) -> __m256 {
        let packed = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), zero);
        _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed)))
    }
}
