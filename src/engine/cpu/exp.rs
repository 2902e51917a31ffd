//! e^x for f32, eight at a time, with the bits of the `expf` that glibc (2.27 on) runs on a CPU with FMA: the
//! softmaxes of attention and sampling and SiLU called it once per value (`__expf_fma` was ≈ 5% of a sampled sweep's
//! profile, one call per score). No crate computes those bits (vector exp crates use other polynomials), and the
//! records must not change, so this is that function's arithmetic written out: ARM's optimized-routines algorithm
//! (2^(k/32) from a table of 32 doubles times a cubic in double precision), with the fused multiply-adds where
//! glibc's FMA build has them (read from its disassembly). Its scalar form is also the fallback, so a CPU without
//! the vector kernel, or a libm other than glibc's, gives the same bits.

use super::tensor::Kernel;

/// 32/ln 2: x · 32/ln 2 = k + r, k an integer, |r| ≤ 1/2.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// 1.5 · 2^52: adding it rounds to an integer held in the low bits of the sum.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// 2^(r/32) ≈ C0·r³ + C1·r² + C2·r + 1.
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
/// bits(2^(i/32)) − (i << 47): adding k << 47 gives 2^(k/32) for k ≡ i (mod 32).
const TABLE: [u64; 32] = [
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b, 0x3fef54873168b9aa,
    0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74,
    0x3feea11473eb0187, 0x3feea589994cce13, 0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
];
/// Inputs whose exponent field is above this (|x| ≥ 88, infinities, NaN) take the checks for overflow and underflow.
const LARGE_TOP: u32 = 0x42a;

/// e^x with glibc's `expf` bits (on an FMA CPU).
pub fn exp(x: f32) -> f32 {
    let bits = x.to_bits();
    let top = (bits >> 20) & 0x7ff;
    if top > LARGE_TOP {
        if bits == f32::NEG_INFINITY.to_bits() {
            return 0.0;
        }
        if top > 0x7f7 {
            return x + x;
        }
        if x > f32::from_bits(0x42b1_7217) {
            return f32::INFINITY;
        }
        if x < f32::from_bits(0xc2cf_f1b4) {
            return 0.0;
        }
        if x < f32::from_bits(0xc2ce_8ecf) {
            // glibc's "may underflow" result: 0x1.4p-75² rounds to the least subnormal.
            return f32::from_bits(1);
        }
    }
    let xd = x as f64;
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = C0.mul_add(r, C1);
    let y = r.mul_add(C2, 1.0);
    (z.mul_add(r * r, y) * s) as f32
}

/// `x ← exp(x)` for each value, eight at a time where the CPU has AVX2 and FMA.
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(Kernel::detect(), Kernel::Avx2 | Kernel::Avx512) {
        // SAFETY: both kernels are only chosen when the CPU reports avx2 and fma (`Kernel::available`).
        return unsafe { avx2::exp_in_place(xs) };
    }
    xs.iter_mut().for_each(|x| *x = exp(*x));
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_loadu_ps(c.as_ptr());
            let top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
            if _mm256_movemask_epi8(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(LARGE_TOP as i32))) != 0 {
                c.iter_mut().for_each(|x| *x = exp(*x));
                continue;
            }
            let lo = exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
            let hi = exp4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_set_m128(hi, lo));
        }
        chunks.into_remainder().iter_mut().for_each(|x| *x = exp(*x));
    }

    /// `exp` of four values with no special case among them, each operation as the scalar one.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp4(xd: __m256d) -> __m128 {
        let (inv_ln2_n, shift) = (_mm256_set1_pd(INV_LN2_N), _mm256_set1_pd(SHIFT));
        let kd = _mm256_fmadd_pd(inv_ln2_n, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, _mm256_and_si256(ki, _mm256_set1_epi64x(31)));
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 65,537th f32 bit pattern (all signs, exponents, NaN and infinities among them) and every pattern near the
    /// bounds where the special cases start.
    fn inputs() -> Vec<f32> {
        // First (so that they fall in a chunk of 8 rather than the remainder): the only two ordinary inputs of all
        // 2^32 (scanned) whose result changes when r = x·32/ln 2 − k is rounded twice instead of fused; the other
        // multiply-adds, unfused, change none.
        let mut bits = vec![0xc27c_65d9, 0x4202_422f];
        bits.extend((0..=u32::MAX / 65_537).map(|i| i * 65_537));
        for edge in [0x42b1_7217u32, 0xc2cf_f1b4, 0xc2ce_8ecf, 0x42b0_0000, 0xc2b0_0000, 0x0000_0000, 0x8000_0000, 0x7f80_0000, 0xff80_0000] {
            bits.extend(edge.saturating_sub(2_000)..=edge.saturating_add(2_000));
        }
        // Attention's and sampling's inputs: x − max ≤ 0, densely.
        bits.extend((0..2_000_000u32).map(|i| 0x8000_0000 | i.wrapping_mul(1_093)));
        bits.into_iter().map(f32::from_bits).collect()
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn eight_at_a_time_gives_the_scalar_bits() {
        // All inputs (a chunk of 8 with a special value among ordinary ones goes the scalar way), then the ordinary
        // ones alone, so that each of them goes the vector way.
        let all = inputs();
        let ordinary: Vec<f32> = all.iter().copied().filter(|x| (x.to_bits() >> 20) & 0x7ff <= LARGE_TOP).collect();
        for xs in [all, ordinary] {
            let mut got = xs.clone();
            exp_in_place(&mut got);
            for (x, g) in xs.iter().zip(&got) {
                assert!(same(*g, exp(*x)), "exp({x:e}) = {g:e} eight at a time, {:e} alone", exp(*x));
            }
        }
    }

    /// The bits are glibc's: on Linux with glibc and an FMA CPU, `f32::exp` is the function this copies.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64"))]
    fn the_bits_are_glibcs() {
        if !is_x86_feature_detected!("fma") {
            return;
        }
        for x in inputs() {
            assert!(same(exp(x), x.exp()), "exp({x:e}): {:e} here, {:e} from glibc", exp(x), x.exp());
        }
    }
}
