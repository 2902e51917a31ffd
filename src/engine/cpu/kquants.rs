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

impl SuperBlock for BlockQ4K {
    /// Sub-block s holds the low (even s) or high (odd s) nibbles of bytes 32·(s/2) .. 32·(s/2) + 32.
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32) {
        let (sc, m) = scale_min(s, &self.scales);
        let bytes = &self.qs[32 * (s / 2)..32 * (s / 2) + 32];
        let shift = 4 * (s % 2);
        (std::array::from_fn(|l| ((bytes[l] >> shift) & 0x0f) as f32), self.d.to_f32() * sc, -self.dmin.to_f32() * m)
    }
}

impl SuperBlock for BlockQ5K {
    /// As Q4_K, with bit s of `qh[l]` as each value's fifth bit.
    fn sub_block(&self, s: usize) -> ([f32; 32], f32, f32) {
        let (sc, m) = scale_min(s, &self.scales);
        let bytes = &self.qs[32 * (s / 2)..32 * (s / 2) + 32];
        let shift = 4 * (s % 2);
        let v = std::array::from_fn(|l| (((bytes[l] >> shift) & 0x0f) | (((self.qh[l] >> s) & 1) << 4)) as f32);
        (v, self.d.to_f32() * sc, -self.dmin.to_f32() * m)
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

/// Super-blocks from GGUF tensor bytes (little-endian, `size_of::<B>()` bytes each).
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
            o.iter_mut().zip(v).for_each(|(o, v)| *o = scale * v + offset);
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
    }
}
