//! A sweep's runs reduced to one row per cell (ratio × temperature): pooled acceptance with its confidence
//! intervals, per-position acceptance, Rao-Blackwellised estimates and the paired difference against the
//! baseline cell (the lowest ratio, normally 0: the full head). Timings are summarised apart, because they are the
//! only part of a sweep that does not repeat exactly.

use crate::stats::{estimate, paired_difference, Bootstrap, Counts, Estimate, Metric, Unit};
use crate::sweep::{Plan, Run};
use anyhow::Result;

#[derive(Clone, Debug, PartialEq)]
pub struct CellSummary {
    pub ratio: f64,
    /// Ids the draft head keeps.
    pub kept: u64,
    pub temperature: f32,
    pub prompts: u32,
    pub repeats: u32,
    /// Turns pooled (prompts × turns × repeats).
    pub runs: u64,
    pub generated: u64,
    pub counts: Counts,
    pub length: Estimate,
    pub rate: Estimate,
    pub rb_length: Estimate,
    pub rb_rate: Estimate,
    /// `per_position[i]`: the share of drafting steps that accepted at least i + 1 drafts.
    pub per_position: Vec<Estimate>,
    pub baseline_ratio: f64,
    /// Mean acceptance length minus the baseline cell's, paired over prompts and repeats.
    pub length_diff: Estimate,
    /// Acceptance rate (points) minus the baseline cell's.
    pub rate_diff: Estimate,
}

/// Where the time of a cell went.
#[derive(Clone, Debug, PartialEq)]
pub struct CellTiming {
    pub ratio: f64,
    pub kept: u64,
    pub temperature: f32,
    pub generated: u64,
    pub drafts: u64,
    pub draft_secs: f64,
    pub target_secs: f64,
    pub draft_ms_per_step: f64,
    /// Generated tokens per second of draft and target time; None at T = 0, where the target time is the fast
    /// path's shared one-token-at-a-time pass rather than verification.
    pub tokens_per_sec: Option<f64>,
    /// Median milliseconds of one draft LM-head evaluation (one row) with this cell's head, timed after the sweep.
    pub head_ms: Option<f64>,
}

/// How plots and reports name a ratio: vanilla for the unpruned head.
pub fn ratio_name(ratio: f64) -> String {
    if ratio == 0.0 {
        "vanilla".into()
    } else {
        format!("ratio {ratio}")
    }
}

/// The temperatures of `cells`, in their order of first appearance.
pub fn temperatures(cells: &[CellSummary]) -> Vec<f32> {
    firsts(cells.iter().map(|c| c.temperature))
}

/// The distinct values, in their order of first appearance.
pub fn firsts<T: PartialEq>(values: impl Iterator<Item = T>) -> Vec<T> {
    values.fold(Vec::new(), |mut seen, v| {
        if !seen.contains(&v) {
            seen.push(v);
        }
        seen
    })
}

fn units(runs: &[&Run]) -> Vec<Unit> {
    runs.iter().map(|r| Unit { prompt: r.prompt.clone(), repeat: r.repeat as usize, counts: (&r.record).into() }).collect()
}

/// The runs of each cell, in plan order (temperature-major, then ratio).
fn cells<'r>(plan: &Plan, runs: &'r [Run]) -> Vec<(usize, usize, Vec<&'r Run>)> {
    let mut out = Vec::new();
    for (ti, &t) in plan.temperatures.iter().enumerate() {
        for (ri, &r) in plan.ratios.iter().enumerate() {
            out.push((ti, ri, runs.iter().filter(|x| x.temperature == t && x.ratio == r).collect()));
        }
    }
    out
}

/// Summaries of every cell; `kept[i]` is the head size of `plan.ratios[i]`.
pub fn summarize(plan: &Plan, kept: &[u64], runs: &[Run]) -> Result<Vec<CellSummary>> {
    let b = Bootstrap { seed: plan.seed, ..Bootstrap::default() };
    let baseline = (0..plan.ratios.len()).min_by(|&a, &c| plan.ratios[a].total_cmp(&plan.ratios[c])).expect("validated: ratios");
    let cells = cells(plan, runs);
    let mut out = Vec::with_capacity(cells.len());
    for (ti, ri, cell) in &cells {
        let us = units(cell);
        let base = units(&cells.iter().find(|(t, r, _)| t == ti && *r == baseline).expect("every cell exists").2);
        let mut counts = Counts::default();
        us.iter().for_each(|u| counts.add(&u.counts));
        let mut prompts: Vec<&str> = cell.iter().map(|r| r.prompt.as_str()).collect();
        prompts.sort_unstable();
        prompts.dedup();
        out.push(CellSummary {
            ratio: plan.ratios[*ri],
            kept: kept[*ri],
            temperature: plan.temperatures[*ti],
            prompts: prompts.len() as u32,
            repeats: plan.repeats,
            runs: cell.len() as u64,
            generated: cell.iter().map(|r| r.record.generated as u64).sum(),
            length: estimate(&us, Metric::MeanAcceptanceLength, b),
            rate: estimate(&us, Metric::AcceptanceRate, b),
            rb_length: estimate(&us, Metric::RaoBlackwellLength, b),
            rb_rate: estimate(&us, Metric::RaoBlackwellRate, b),
            per_position: (0..plan.k).map(|i| estimate(&us, Metric::PerPosition(i), b)).collect(),
            baseline_ratio: plan.ratios[baseline],
            length_diff: paired_difference(&us, &base, Metric::MeanAcceptanceLength, b)?,
            rate_diff: paired_difference(&us, &base, Metric::AcceptanceRate, b)?,
            counts,
        });
    }
    Ok(out)
}

/// `head_ms[i]`: the head time of `plan.ratios[i]`.
pub fn timings(plan: &Plan, kept: &[u64], head_ms: &[f64], runs: &[Run]) -> Vec<CellTiming> {
    cells(plan, runs)
        .into_iter()
        .map(|(ti, ri, cell)| {
            let sum = |f: fn(&Run) -> f64| cell.iter().map(|r| f(r)).sum::<f64>();
            let (draft_secs, target_secs) = (sum(|r| r.record.draft_secs), sum(|r| r.record.target_secs));
            let generated = cell.iter().map(|r| r.record.generated as u64).sum::<u64>();
            let drafts = cell.iter().map(|r| r.record.drafts).sum::<u64>();
            let temperature = plan.temperatures[ti];
            CellTiming {
                ratio: plan.ratios[ri],
                kept: kept[ri],
                temperature,
                generated,
                drafts,
                draft_secs,
                target_secs,
                draft_ms_per_step: if drafts == 0 { 0.0 } else { 1e3 * draft_secs / drafts as f64 },
                tokens_per_sec: (!crate::sampling::is_greedy(temperature)).then(|| generated as f64 / (draft_secs + target_secs).max(1e-9)),
                head_ms: Some(head_ms[ri]),
            }
        })
        .collect()
}
