//! ggml's K-quant super-blocks (Q4_K, Q5_K, Q6_K: what Q4_K_M files hold), kept in their GGUF layout.
//!
//! The kernels see a super-block of 256 values as eight sub-blocks of 32, each `value = scale · v + offset` with `v`
//! integer-valued f32s and one scale and offset per sub-block, so the existing per-32 machinery (`dots_blocks`, the
//! activation sums behind offsets) serves them unchanged. Q4_K and Q5_K: v = q, scale = d · sc, offset = −dmin · m,
//! as ggml dequantizes them; Q6_K, whose sub-scales cover 16 values: v = sc · (q − 32) (|v| ≤ 4096, exact), scale = d.

use half::f16;

/// Values per super-block.
pub const QK_K: usize = 256;
/// Sub-blocks of 32 per super-block.
pub const SUBS: usize = QK_K / 32;

/// A super-block as the kernels read it.
pub trait SuperBlock: Copy + Send + Sync {
    /// Sub-block `s` (0..8): its 32 values `v`, `scale` and `offset`, the weights being `scale · v + offset`.
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32);
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// The 6-bit scale and min of sub-block `j`, packed in 12 bytes as ggml's `get_scale_min_k4` reads them.
pub fn scale_min(j: usize, q: &[u8; 12]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) as f32, ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32)
    }
}

/// Q4_K and Q5_K: each value `d · sc · q − dmin · m` with a 6-bit scale and min per sub-block of 32.
pub trait ScaleMinBlock {
    /// `d`, `dmin` and the 12 bytes of packed scales and mins.
    fn header(&self) -> (f16, f16, &[u8; 12]);
    /// Value `l` (0..32) of sub-block `s` as its unsigned integer `q`.
    fn q(&self, s: usize, l: usize) -> u8;
}

impl ScaleMinBlock for BlockQ4K {
    fn header(&self) -> (f16, f16, &[u8; 12]) {
        (self.d, self.dmin, &self.scales)
    }

    /// Sub-block s holds the low (even s) or high (odd s) nibbles of bytes 32·(s/2) .. 32·(s/2) + 32.
    fn q(&self, s: usize, l: usize) -> u8 {
        (self.qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f
    }
}

impl ScaleMinBlock for BlockQ5K {
    fn header(&self) -> (f16, f16, &[u8; 12]) {
        (self.d, self.dmin, &self.scales)
    }

    /// As Q4_K, with bit s of `qh[l]` as each value's fifth bit.
    fn q(&self, s: usize, l: usize) -> u8 {
        ((self.qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f) | (((self.qh[l] >> s) & 1) << 4)
    }
}

fn scale_min_sub_block(b: &impl ScaleMinBlock, s: usize) -> ([f32; 32], f32, f32) {
    let (d, dmin, scales) = b.header();
    let (sc, m) = scale_min(s, scales);
    (std::array::from_fn(|l| b.q(s, l) as f32), d.to_f32() * sc, -dmin.to_f32() * m)
}

impl SuperBlock for BlockQ4K {
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32) {
        scale_min_sub_block(self, s)
    }
}

impl SuperBlock for BlockQ5K {
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32) {
        scale_min_sub_block(self, s)
    }
}

impl SuperBlock for BlockQ6K {
    /// Sub-block s lies in half h = s/4 at quarter k = s%4: low (k < 2) or high nibbles of `ql[64h + 32(k%2) + l]`,
    /// two high bits at 2k of `qh[32h + l]`, minus 32; sub-scales per 16 values, `scales[8h + 2k + l/16]`.
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32) {
        let (h, k) = (s / 4, s % 4);
        let low = &self.ql[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32];
        let shift = 4 * (k / 2);
        let v = std::array::from_fn(|l| {
            let q = ((low[l] >> shift) & 0x0f) | (((self.qh[32 * h + l] >> (2 * k)) & 3) << 4);
            self.scales[8 * h + 2 * k + l / 16] as f32 * (q as f32 - 32.0)
        });
        (v, self.d.to_f32(), 0.0)
    }
}

/// Activations as ggml's Q8_K, for the integer products: 256 values as `d · qs`, with the sums of each 16 `qs`.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

/// Appends the Q8_K blocks of `x` (a whole number of super-blocks) to `out`: per block d = max |x| / 127 and
/// q = round(x · 127 / max |x|), ties to even (ggml's `quantize_row_q8_K` signs d so that the largest value becomes
/// −127; a positive d is as exact and the vector version gives these bits).
pub fn quantize_q8k(x: &[f32], out: &mut Vec<BlockQ8K>) {
    for xs in x.chunks_exact(QK_K) {
        let mut b = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] };
        b.d = super::q8::quantize_run(xs, &mut b.qs);
        sum_sixteens(&mut b);
        out.push(b);
    }
}

/// The block's `bsums` from its `qs`.
pub fn sum_sixteens(b: &mut BlockQ8K) {
    for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
}

/// A super-block's product with Q8_K activations from exact integer sums, combined in f32 the one way every kernel
/// combines them (so the vector kernels give the scalar one's bits).
pub trait IntegerDot: SuperBlock {
    /// Σ w·a over the super-block, in the scalar reference arithmetic.
    fn dot_q8k(&self, a: &BlockQ8K) -> f32;
}

/// `d · a.d · Σ sc·(q·a) − dmin · a.d · Σ m·(a's sums)` for Q4_K and Q5_K, whose values are `d·sc·q − dmin·m`.
#[inline]
pub fn combine(d: f32, dmin: f32, a: f32, scaled: i32, mins: i32) -> f32 {
    a * d * scaled as f32 - a * dmin * mins as f32
}

/// The eight sub-block scales and the eight mins of a Q4_K or Q5_K super-block (`scale_min` for every j), decoded
/// with ggml's masks on four 32-bit words: once per super-block, for all activation rows.
#[inline]
pub fn scales_mins(q: &[u8; 12]) -> ([u8; SUBS], [u8; SUBS]) {
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let (six, low, two) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let scales = [w0 & six, (w2 & low) | (((w0 >> 6) & two) << 4)];
    let mins = [w1 & six, ((w2 >> 4) & low) | (((w1 >> 6) & two) << 4)];
    let bytes = |w: [u32; 2]| {
        let (a, b) = (w[0].to_le_bytes(), w[1].to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (bytes(scales), bytes(mins))
}

/// Σ_j m_j · (a's sum over sub-block j), the offset term of Q4_K and Q5_K.
#[inline]
pub fn mins_term(mins: &[u8; SUBS], a: &BlockQ8K) -> i32 {
    (0..SUBS).map(|j| mins[j] as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32)).sum()
}

fn scale_min_dot(b: &impl ScaleMinBlock, a: &BlockQ8K) -> f32 {
    let (d, dmin, scales) = b.header();
    let (sc, mins) = scales_mins(scales);
    let scaled = (0..SUBS).map(|s| sc[s] as i32 * (0..32).map(|l| b.q(s, l) as i32 * a.qs[32 * s + l] as i32).sum::<i32>()).sum();
    combine(d.to_f32(), dmin.to_f32(), a.d, scaled, mins_term(&mins, a))
}

impl IntegerDot for BlockQ4K {
    fn dot_q8k(&self, a: &BlockQ8K) -> f32 {
        scale_min_dot(self, a)
    }
}

impl IntegerDot for BlockQ5K {
    fn dot_q8k(&self, a: &BlockQ8K) -> f32 {
        scale_min_dot(self, a)
    }
}

impl IntegerDot for BlockQ6K {
    /// `d · a.d · Σ_g sc_g · (Σ q·a − 32 · a's sum)` over the sixteen groups of 16 (q unsigned, 0..63).
    fn dot_q8k(&self, a: &BlockQ8K) -> f32 {
        let scaled: i32 = (0..SUBS)
            .map(|s| {
                let (h, k) = (s / 4, s % 4);
                let low = &self.ql[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32];
                let q = |l: usize| (((low[l] >> (4 * (k / 2))) & 0x0f) | (((self.qh[32 * h + l] >> (2 * k)) & 3) << 4)) as i32;
                (0..2)
                    .map(|half| {
                        let g = 2 * s + half;
                        let qa: i32 = (16 * half..16 * half + 16).map(|l| q(l) * a.qs[32 * s + l] as i32).sum();
                        self.scales[8 * h + 2 * k + half] as i32 * (qa - 32 * a.bsums[g] as i32)
                    })
                    .sum::<i32>()
            })
            .sum();
        a.d * self.d.to_f32() * scaled as f32
    }
}

/// Super-blocks from GGUF tensor bytes (little-endian, `size_of::<B>()` bytes each). Tests only: loading reads
/// blocks in place (`loading::weights`).
#[cfg(test)]
pub fn parse<B: SuperBlock>(bytes: &[u8]) -> Vec<B> {
    let size = std::mem::size_of::<B>();
    bytes
        .chunks_exact(size)
        // SAFETY: B is a repr(C) struct of u8/i8 arrays and f16s with no padding (sizes 144, 176, 210 as in ggml),
        // and any bit pattern is a valid value; read_unaligned copes with the byte slice's alignment.
        .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const B) })
        .collect()
}

/// Row values, dequantized (embedding lookup, tests).
pub fn dequantize<B: SuperBlock>(blocks: &[B], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (s, o) in o.chunks_exact_mut(32).enumerate() {
            let (v, scale, offset) = b.sub_block(s);
            o.iter_mut().zip(v).for_each(|(o, v)| *o = scale.mul_add(v, offset));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_ggmls_sizes() {
        assert_eq!(std::mem::size_of::<BlockQ4K>(), 144);
        assert_eq!(std::mem::size_of::<BlockQ5K>(), 176);
        assert_eq!(std::mem::size_of::<BlockQ6K>(), 210);
        assert_eq!(std::mem::size_of::<BlockQ8K>(), 292);
    }

    #[test]
    fn masked_scales_are_the_scale_min_of_each_sub_block() {
        for seed in 0u32..64 {
            let q: [u8; 12] = std::array::from_fn(|i| (seed.wrapping_mul(2654435761).rotate_left(i as u32 * 3) >> 7) as u8);
            let (scales, mins) = scales_mins(&q);
            for j in 0..SUBS {
                assert_eq!((scales[j] as f32, mins[j] as f32), scale_min(j, &q), "sub-block {j} of {q:?}");
            }
        }
    }

    #[test]
    fn q8k_keeps_the_largest_value_and_sums_each_sixteen() {
        let x: Vec<f32> = (0..2 * QK_K).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let mut blocks = Vec::new();
        quantize_q8k(&x, &mut blocks);
        assert_eq!(blocks.len(), 2);
        for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (q, v) in b.qs.iter().zip(xs) {
                assert!((b.d * *q as f32 - v).abs() <= b.d.abs() / 2.0 + 1e-6, "{v} became {q} × {}", b.d);
            }
            assert!(b.qs.iter().any(|q| q.unsigned_abs() == 127) && (b.d.abs() * 127.0 - amax).abs() < 1e-5);
            for (g, s) in b.bsums.iter().enumerate() {
                assert_eq!(*s as i32, b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum::<i32>());
            }
        }
        let mut zero = Vec::new();
        quantize_q8k(&[0.0; QK_K], &mut zero);
        assert!(zero[0].d == 0.0 && zero[0].qs.iter().all(|&q| q == 0));
    }
}
