//! Turning logits into a distribution (temperature, top-p) and drawing from it with a caller's random stream.

use crate::engine::cpu::exp::exp_in_place;
use anyhow::{bail, Result};
use rand::RngExt;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
}

/// Temperature 0 means greedy decoding: one pass stands for every repeat and ratio.
pub fn is_greedy(temperature: f32) -> bool {
    temperature == 0.0
}

impl Sampling {
    pub fn new(temperature: f32, top_p: f32) -> Result<Sampling> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            bail!("temperature must be a finite number ≥ 0, got {temperature}");
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            bail!("top-p must be in (0, 1], got {top_p}");
        }
        Ok(Sampling { temperature, top_p })
    }

    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0 };

    pub fn is_greedy(&self) -> bool {
        is_greedy(self.temperature)
    }

    /// The distribution these settings put on `logits`, written into `probs`. Greedy is a point mass on the
    /// argmax. `order` is scratch for top-p.
    pub fn distribution(&self, logits: &[f32], probs: &mut Vec<f32>, order: &mut Vec<u32>) {
        probs.clear();
        probs.resize(logits.len(), 0.0);
        if self.is_greedy() {
            probs[argmax(logits) as usize] = 1.0;
            return;
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        probs.iter_mut().zip(logits).for_each(|(p, l)| *p = (l - max) / self.temperature);
        exp_in_place(probs);
        let sum = probs.iter().fold(0f64, |sum, p| sum + *p as f64);
        let inv = (1.0 / sum) as f32;
        probs.iter_mut().for_each(|p| *p *= inv);
        if self.top_p < 1.0 {
            // Keep the smallest set of most likely tokens whose mass reaches top_p (ties broken by id).
            order.clear();
            order.extend(0..probs.len() as u32);
            order.sort_unstable_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]).then(a.cmp(&b)));
            let mut mass = 0f64;
            let mut keep = order.len();
            for (i, &t) in order.iter().enumerate() {
                mass += probs[t as usize] as f64;
                if mass >= self.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            for &t in &order[keep..] {
                probs[t as usize] = 0.0;
            }
            let kept: f64 = order[..keep].iter().map(|&t| probs[t as usize] as f64).sum();
            let inv = (1.0 / kept) as f32;
            probs.iter_mut().for_each(|p| *p *= inv);
        }
    }
}

/// Index of the largest value; the lowest index wins a tie, so greedy decoding is reproducible.
pub fn argmax(values: &[f32]) -> u32 {
    argmax_of(values.iter().copied())
}

/// `argmax` of values as they come (a row of another number type, converted on the way, with no copy of it).
pub fn argmax_of(values: impl IntoIterator<Item = f32>) -> u32 {
    let mut values = values.into_iter().enumerate();
    let Some((_, mut largest)) = values.next() else { return 0 };
    let mut best = 0;
    for (i, v) in values {
        if v > largest {
            (best, largest) = (i, v);
        }
    }
    best as u32
}

/// Draw an index from `probs` (which sums to 1) with one uniform number from `rng`.
pub fn draw(probs: &[f32], rng: &mut (impl rand::Rng + ?Sized)) -> u32 {
    draw_with(probs, rng.random())
}

/// Draw an index from `probs` (which sums to 1) with the uniform number `u` in [0, 1): the first index where the
/// running sum passes u.
pub fn draw_with(probs: &[f32], u: f64) -> u32 {
    let mut acc = 0f64;
    let mut last_nonzero = 0;
    for (i, p) in probs.iter().enumerate() {
        if *p > 0.0 {
            acc += *p as f64;
            last_nonzero = i;
            if u < acc {
                return i as u32;
            }
        }
    }
    // Rounding left the total a hair under 1 and u landed above it.
    last_nonzero as u32
}

/// `log softmax(logits)[token]`.
pub fn log_prob(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|l| (*l as f64 - max).exp()).sum::<f64>().ln() + max;
    logits[token as usize] as f64 - lse
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn top_p_keeps_the_smallest_head_reaching_the_mass() {
        let s = Sampling::new(1.0, 0.7).unwrap();
        let logits = [2.0f32.ln(), 5.0f32.ln(), 3.0f32.ln()]; // p = 0.2, 0.5, 0.3
        let (mut p, mut o) = (vec![], vec![]);
        s.distribution(&logits, &mut p, &mut o);
        assert!((p[1] - 0.625).abs() < 1e-6 && (p[2] - 0.375).abs() < 1e-6 && p[0] == 0.0, "{p:?}");
    }

    #[test]
    fn draws_follow_the_distribution() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let probs = [0.1f32, 0.0, 0.6, 0.3];
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[draw(&probs, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (c, p) in counts.iter().zip(probs) {
            assert!((*c as f64 / 20_000.0 - p as f64).abs() < 0.015, "{counts:?}");
        }
    }

    #[test]
    fn argmax_takes_the_lowest_of_tied_indices_and_compares_nothing_with_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(argmax(&[]), 0);
        // A NaN first is never beaten (nothing compares larger), as the host's greedy choice always did.
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax_of([1u8, 7, 7].map(f32::from)), 1);
    }

    #[test]
    fn invalid_settings_are_refused() {
        assert!(Sampling::new(-1.0, 1.0).is_err());
        assert!(Sampling::new(1.0, 0.0).is_err());
        assert!(Sampling::new(f32::NAN, 1.0).is_err());
    }
}
