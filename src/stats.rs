//! Acceptance statistics with confidence intervals (../shared/reference/NOTES.md, "Statistics").
//!
//! Counts are pooled over prompts, turns and repeats (vLLM's ratio estimators). Acceptance varies far more between
//! prompts than between seeds, so the prompt is the unit of resampling: the bootstrap draws prompts with
//! replacement and every turn and repeat of a drawn prompt goes along. A second interval is the t-interval over the
//! per-repeat pooled values. Differences against a baseline cell reuse the same resample of prompts for both cells,
//! which with common random numbers removes most of the noise the two cells share.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};
use std::collections::BTreeMap;

/// Summed counters of any set of turns.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counts {
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted: u64,
    /// Σ of the Rao-Blackwellised expected accepted counts.
    pub expected_accepted: f64,
    pub accepted_per_pos: Vec<u64>,
}

impl Counts {
    pub fn add(&mut self, other: &Counts) {
        self.scaled_add(other, 1);
    }

    /// Add `times` copies of `other` (a prompt drawn that often by the bootstrap).
    fn scaled_add(&mut self, other: &Counts, times: u64) {
        self.drafts += other.drafts * times;
        self.draft_tokens += other.draft_tokens * times;
        self.accepted += other.accepted * times;
        self.expected_accepted += other.expected_accepted * times as f64;
        if self.accepted_per_pos.len() < other.accepted_per_pos.len() {
            self.accepted_per_pos.resize(other.accepted_per_pos.len(), 0);
        }
        self.accepted_per_pos.iter_mut().zip(&other.accepted_per_pos).for_each(|(a, b)| *a += b * times);
    }
}

/// What is estimated from pooled counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// 1 + accepted / drafts (includes the bonus token; 1.0 without drafts).
    MeanAcceptanceLength,
    /// 100 · accepted / draft tokens.
    AcceptanceRate,
    /// 1 + Σ expected accepted / drafts.
    RaoBlackwellLength,
    /// 100 · Σ expected accepted / draft tokens.
    RaoBlackwellRate,
    /// Steps accepting at least i + 1 drafts / drafts.
    PerPosition(usize),
}

impl Metric {
    pub fn of(&self, c: &Counts) -> f64 {
        let per_draft = |x: f64| if c.drafts == 0 { 0.0 } else { x / c.drafts as f64 };
        match *self {
            Metric::MeanAcceptanceLength => 1.0 + per_draft(c.accepted as f64),
            Metric::AcceptanceRate if c.draft_tokens == 0 => 0.0,
            Metric::AcceptanceRate => 100.0 * c.accepted as f64 / c.draft_tokens as f64,
            Metric::RaoBlackwellLength => 1.0 + per_draft(c.expected_accepted),
            Metric::RaoBlackwellRate if c.draft_tokens == 0 => 0.0,
            Metric::RaoBlackwellRate => 100.0 * c.expected_accepted / c.draft_tokens as f64,
            Metric::PerPosition(i) => per_draft(c.accepted_per_pos.get(i).copied().unwrap_or(0) as f64),
        }
    }
}

/// One turn's counts and where it belongs.
#[derive(Clone, Debug)]
pub struct Unit {
    pub prompt: String,
    pub repeat: usize,
    pub counts: Counts,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Interval {
    pub lo: f64,
    pub hi: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// The pooled value over every unit.
    pub value: f64,
    /// 95% percentile bootstrap over prompts.
    pub bootstrap: Interval,
    /// 95% t-interval over the per-repeat pooled values; None with one repeat.
    pub t: Option<Interval>,
}

/// How the bootstrap is drawn.
#[derive(Clone, Copy, Debug)]
pub struct Bootstrap {
    pub resamples: usize,
    pub seed: u64,
}

impl Default for Bootstrap {
    fn default() -> Bootstrap {
        Bootstrap { resamples: 2000, seed: 0 }
    }
}

/// Counts per prompt (in prompt order) and per repeat.
struct Grouped {
    by_prompt: Vec<Counts>,
    by_repeat: Vec<Counts>,
    total: Counts,
}

fn group(units: &[Unit], prompts: &[String]) -> Grouped {
    let index: BTreeMap<&str, usize> = prompts.iter().enumerate().map(|(i, p)| (p.as_str(), i)).collect();
    let mut by_prompt = vec![Counts::default(); prompts.len()];
    let mut by_repeat: BTreeMap<usize, Counts> = BTreeMap::new();
    let mut total = Counts::default();
    for u in units {
        by_prompt[index[u.prompt.as_str()]].add(&u.counts);
        by_repeat.entry(u.repeat).or_default().add(&u.counts);
        total.add(&u.counts);
    }
    Grouped { by_prompt, by_repeat: by_repeat.into_values().collect(), total }
}

/// The distinct prompts of `units`, sorted: the resampling units.
fn prompts_of(units: &[Unit]) -> Vec<String> {
    let mut p: Vec<String> = units.iter().map(|u| u.prompt.clone()).collect();
    p.sort();
    p.dedup();
    p
}

/// For each resample, how many times each prompt was drawn. The same draws serve every cell of a sweep, which is
/// what makes paired differences paired.
fn resample_weights(prompts: usize, b: Bootstrap) -> Vec<Vec<u64>> {
    let mut rng = ChaCha20Rng::seed_from_u64(b.seed);
    (0..b.resamples)
        .map(|_| {
            let mut w = vec![0u64; prompts];
            for _ in 0..prompts {
                w[rng.random_range(0..prompts)] += 1;
            }
            w
        })
        .collect()
}

fn weighted(by_prompt: &[Counts], weights: &[u64]) -> Counts {
    let mut c = Counts::default();
    for (p, &w) in by_prompt.iter().zip(weights) {
        c.scaled_add(p, w);
    }
    c
}

/// Linear-interpolation quantile (numpy's default) of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn percentile_interval(mut values: Vec<f64>) -> Interval {
    values.sort_by(f64::total_cmp);
    Interval { lo: quantile(&values, 0.025), hi: quantile(&values, 0.975) }
}

/// 95% t-interval of the mean of `values`; None for fewer than two.
pub fn t_interval(values: &[f64]) -> Option<Interval> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let sd = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
    let t = StudentsT::new(0.0, 1.0, (n - 1) as f64).expect("n ≥ 2").inverse_cdf(0.975);
    let half = t * sd / (n as f64).sqrt();
    Some(Interval { lo: mean - half, hi: mean + half })
}

/// The pooled `metric` of `units` with its two 95% intervals.
pub fn estimate(units: &[Unit], metric: Metric, b: Bootstrap) -> Estimate {
    let prompts = prompts_of(units);
    let g = group(units, &prompts);
    let boot = resample_weights(prompts.len(), b).iter().map(|w| metric.of(&weighted(&g.by_prompt, w))).collect();
    let per_repeat: Vec<f64> = g.by_repeat.iter().map(|c| metric.of(c)).collect();
    Estimate { value: metric.of(&g.total), bootstrap: percentile_interval(boot), t: t_interval(&per_repeat) }
}

/// `metric` of each prompt's pooled counts, in sorted prompt order.
pub fn by_prompt(units: &[Unit], metric: Metric) -> Vec<f64> {
    group(units, &prompts_of(units)).by_prompt.iter().map(|c| metric.of(c)).collect()
}

/// `metric(units) − metric(baseline)` with intervals from the same prompt resamples (bootstrap) and the
/// per-repeat differences (t). Both cells must cover the same prompts and repeats.
pub fn paired_difference(units: &[Unit], baseline: &[Unit], metric: Metric, b: Bootstrap) -> anyhow::Result<Estimate> {
    let prompts = prompts_of(units);
    if prompts != prompts_of(baseline) {
        anyhow::bail!("a paired difference needs the same prompts in both cells");
    }
    let (g, base) = (group(units, &prompts), group(baseline, &prompts));
    if g.by_repeat.len() != base.by_repeat.len() {
        anyhow::bail!("a paired difference needs the same repeats in both cells");
    }
    let boot = resample_weights(prompts.len(), b)
        .iter()
        .map(|w| metric.of(&weighted(&g.by_prompt, w)) - metric.of(&weighted(&base.by_prompt, w)))
        .collect();
    let per_repeat: Vec<f64> = g.by_repeat.iter().zip(&base.by_repeat).map(|(a, b)| metric.of(a) - metric.of(b)).collect();
    Ok(Estimate {
        value: metric.of(&g.total) - metric.of(&base.total),
        bootstrap: percentile_interval(boot),
        t: t_interval(&per_repeat),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(prompt: &str, repeat: usize, drafts: u64, accepted: u64, k: u64) -> Unit {
        Unit {
            prompt: prompt.into(),
            repeat,
            counts: Counts { drafts, draft_tokens: drafts * k, accepted, expected_accepted: accepted as f64, accepted_per_pos: vec![] },
        }
    }

    #[test]
    fn one_prompt_one_repeat_collapses_the_bootstrap_and_has_no_t_interval() {
        let e = estimate(&[unit("81", 0, 10, 14, 4)], Metric::MeanAcceptanceLength, Bootstrap::default());
        assert_eq!(e.value, 2.4);
        assert_eq!(e.bootstrap, Interval { lo: 2.4, hi: 2.4 });
        assert_eq!(e.t, None);
    }

    #[test]
    fn all_and_none_accepted() {
        let all = [unit("a", 0, 5, 20, 4), unit("b", 0, 3, 12, 4)];
        let e = estimate(&all, Metric::MeanAcceptanceLength, Bootstrap::default());
        assert_eq!((e.value, e.bootstrap), (5.0, Interval { lo: 5.0, hi: 5.0 }));
        assert_eq!(estimate(&all, Metric::AcceptanceRate, Bootstrap::default()).value, 100.0);
        let none = [unit("a", 0, 5, 0, 4), unit("b", 0, 3, 0, 4)];
        let e = estimate(&none, Metric::MeanAcceptanceLength, Bootstrap::default());
        assert_eq!((e.value, e.bootstrap), (1.0, Interval { lo: 1.0, hi: 1.0 }));
        assert_eq!(estimate(&none, Metric::AcceptanceRate, Bootstrap::default()).value, 0.0);
    }

    #[test]
    fn t_interval_matches_the_hand_computed_one() {
        // Per-repeat lengths 2.0, 2.2, 2.4: mean 2.2, sd 0.2, t(0.975, 2) = 4.302653 → ± 0.496828.
        let units = [unit("a", 0, 10, 10, 4), unit("a", 1, 10, 12, 4), unit("a", 2, 10, 14, 4)];
        let e = estimate(&units, Metric::MeanAcceptanceLength, Bootstrap::default());
        let t = e.t.unwrap();
        assert!((t.lo - 1.703172).abs() < 1e-5 && (t.hi - 2.696828).abs() < 1e-5, "{t:?}");
        assert!((e.value - 2.2).abs() < 1e-12);
    }

    #[test]
    fn bootstrap_over_two_prompts_spans_their_extremes() {
        // A alone gives 1.0, B alone 2.0, one of each 1.5: the 95% percentile interval is [1.0, 2.0].
        let units = [unit("a", 0, 10, 0, 4), unit("b", 0, 10, 10, 4)];
        let e = estimate(&units, Metric::MeanAcceptanceLength, Bootstrap { resamples: 4000, seed: 3 });
        assert_eq!(e.value, 1.5);
        assert_eq!(e.bootstrap, Interval { lo: 1.0, hi: 2.0 });
    }

    #[test]
    fn paired_differences_share_the_resamples() {
        let base = [unit("a", 0, 10, 5, 4), unit("b", 0, 10, 25, 4), unit("c", 0, 10, 12, 4)];
        let same = estimate(&base, Metric::AcceptanceRate, Bootstrap::default());
        let d = paired_difference(&base, &base, Metric::AcceptanceRate, Bootstrap::default()).unwrap();
        assert_eq!((d.value, d.bootstrap), (0.0, Interval { lo: 0.0, hi: 0.0 }));
        assert!(same.bootstrap.hi > same.bootstrap.lo, "the value itself varies between resamples");
        // Every prompt loses exactly one accepted draft of its 40 draft tokens: the difference is −2.5 points in
        // every resample, although each cell's own interval is wide.
        let worse: Vec<Unit> = base.iter().map(|u| unit(&u.prompt, 0, 10, u.counts.accepted - 1, 4)).collect();
        let d = paired_difference(&worse, &base, Metric::AcceptanceRate, Bootstrap::default()).unwrap();
        assert!((d.value + 2.5).abs() < 1e-12 && (d.bootstrap.lo + 2.5).abs() < 1e-12 && (d.bootstrap.hi + 2.5).abs() < 1e-12, "{d:?}");
        let other = [unit("z", 0, 10, 5, 4)];
        assert!(paired_difference(&other, &base, Metric::AcceptanceRate, Bootstrap::default()).is_err());
    }
}
