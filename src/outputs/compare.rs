//! Two sweeps of the same prompts side by side, cell by cell: each one's estimates and the paired difference,
//! resampling the same prompts for both (`stats::paired_difference`). What tells whether one draft (a retrained
//! head, another engine) is better than another, or only looks it.

use super::report::with_ci;
use super::store::{self, RunCounts};
use crate::stats::{by_prompt, estimate, paired_difference, Bootstrap, Estimate, Metric, Unit};
use anyhow::{bail, Result};
use std::path::Path;

/// One cell (ratio × temperature) of both sweeps.
#[derive(Clone, Debug)]
pub struct Row {
    pub ratio: f64,
    pub temperature: f32,
    pub prompts: usize,
    pub base: Estimate,
    pub other: Estimate,
    /// other − base, paired over prompts.
    pub difference: Estimate,
    pub rate_difference: Estimate,
    /// Prompts whose mean acceptance length is higher in the other sweep, and lower.
    pub better: usize,
    pub worse: usize,
}

/// The runs of a sweep folder.
pub fn runs(dir: &Path) -> Result<Vec<RunCounts>> {
    let path = dir.join(store::RUNS);
    if !path.exists() {
        bail!("{} holds no {}: is it a sweep folder?", dir.display(), store::RUNS);
    }
    store::read_runs(&path)
}

/// Every cell the two sweeps share, in the base sweep's order; both must hold the same prompts and repeats there.
pub fn compare(base: &[RunCounts], other: &[RunCounts], b: Bootstrap) -> Result<Vec<Row>> {
    let mut cells: Vec<(f64, f32)> = Vec::new();
    for r in base {
        if !cells.contains(&(r.ratio, r.temperature)) && other.iter().any(|o| (o.ratio, o.temperature) == (r.ratio, r.temperature)) {
            cells.push((r.ratio, r.temperature));
        }
    }
    if cells.is_empty() {
        bail!("the two sweeps share no cell (ratio and temperature)");
    }
    let units = |runs: &[RunCounts], (ratio, t): (f64, f32)| -> Vec<Unit> {
        runs.iter().filter(|r| r.ratio == ratio && r.temperature == t).map(|r| r.unit.clone()).collect()
    };
    cells
        .into_iter()
        .map(|cell| {
            let (a, o) = (units(base, cell), units(other, cell));
            let difference = paired_difference(&o, &a, Metric::MeanAcceptanceLength, b)
                .map_err(|e| anyhow::anyhow!("ratio {} at T = {}: {e}", cell.0, cell.1))?;
            let (better, worse, tied) = per_prompt(&a, &o);
            Ok(Row {
                ratio: cell.0,
                temperature: cell.1,
                prompts: better + worse + tied,
                base: estimate(&a, Metric::MeanAcceptanceLength, b),
                other: estimate(&o, Metric::MeanAcceptanceLength, b),
                difference,
                rate_difference: paired_difference(&o, &a, Metric::AcceptanceRate, b)?,
                better,
                worse,
            })
        })
        .collect()
}

/// Prompts better, worse and the same in `other`; both hold the same prompts (checked before).
fn per_prompt(base: &[Unit], other: &[Unit]) -> (usize, usize, usize) {
    let (a, o) = (by_prompt(base, Metric::MeanAcceptanceLength), by_prompt(other, Metric::MeanAcceptanceLength));
    let count = |want: std::cmp::Ordering| a.iter().zip(&o).filter(|(x, y)| y.total_cmp(x) == want).count();
    (count(std::cmp::Ordering::Greater), count(std::cmp::Ordering::Less), count(std::cmp::Ordering::Equal))
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row], base_name: &str, other_name: &str) -> String {
    let signed = |e: &Estimate, d: usize| format!("{:+.d$} [{:+.d$}, {:+.d$}]", e.value, e.bootstrap.lo, e.bootstrap.hi, d = d);
    let mut out = format!(
        "| ratio | T | prompts | mean acceptance length, {base_name} | mean acceptance length, {other_name} | paired difference | acceptance rate difference (points) | better / worse |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} |\n",
            r.ratio,
            r.temperature,
            r.prompts,
            with_ci(&r.base, 3),
            with_ci(&r.other, 3),
            signed(&r.difference, 3),
            signed(&r.rate_difference, 1),
            r.better,
            r.worse
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Counts;

    fn run(ratio: f64, prompt: &str, drafts: u64, accepted: u64) -> RunCounts {
        let counts = Counts { drafts, draft_tokens: 4 * drafts, accepted, expected_accepted: accepted as f64, accepted_per_pos: vec![] };
        RunCounts { ratio, temperature: 0.0, unit: Unit { prompt: prompt.into(), repeat: 0, counts } }
    }

    #[test]
    fn the_paired_difference_is_other_minus_base_over_the_shared_cells() {
        // Ratio 0 in both; ratio 0.5 only in the base. Base lengths 1.5 and 2.0 (pooled 1.75), other 2.0 and 2.0.
        let base = [run(0.0, "81", 10, 5), run(0.0, "82", 10, 10), run(0.5, "81", 10, 1)];
        let other = [run(0.0, "82", 10, 10), run(0.0, "81", 10, 10)];
        let rows = compare(&base, &other, Bootstrap::default()).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.ratio, r.prompts, r.better, r.worse), (0.0, 2, 1, 0));
        assert!((r.base.value - 1.75).abs() < 1e-12 && (r.other.value - 2.0).abs() < 1e-12);
        assert!((r.difference.value - 0.25).abs() < 1e-12 && (r.rate_difference.value - 6.25).abs() < 1e-9);
        // Resampling {81, 82}: the difference is 0.5 · share of 81 in the resample: between 0 and 0.5.
        assert!(r.difference.bootstrap.lo >= 0.0 && r.difference.bootstrap.hi <= 0.5 + 1e-12, "{:?}", r.difference);
        let table = table(&rows, "A", "B");
        assert!(table.contains("| 0 | 0 | 2 | 1.750 [") && table.contains("+0.250 [") && table.contains("| 1 / 0 |"), "{table}");
    }

    #[test]
    fn sweeps_of_other_prompts_do_not_compare() {
        let e = compare(&[run(0.0, "81", 10, 5)], &[run(0.0, "82", 10, 5)], Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("ratio 0 at T = 0") && e.contains("same prompts"), "{e}");
        let e = compare(&[run(0.0, "81", 10, 5)], &[run(0.5, "81", 10, 5)], Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("share no cell"), "{e}");
    }
}
