//! Two sweeps of the same prompts side by side, cell by cell: each one's estimates and the paired difference,
//! resampling the same prompts for both (`stats::paired_difference`). What tells whether one draft (a retrained
//! head, another engine) is better than another, or only looks it.

use super::report::{printed_ratio, with_ci};
use super::store::{self, RunCounts};
use crate::stats::{by_prompt, estimate, paired_difference, Bootstrap, Estimate, Metric, Unit};
use anyhow::{anyhow, bail, Result};
use std::collections::BTreeSet;
use std::path::Path;

/// One cell (ratio × temperature) of both sweeps, over all its prompts or one category's.
#[derive(Clone, Debug)]
pub struct Row {
    pub ratio: f64,
    /// The other sweep's ratio: `ratio` unless `--pair` matched two.
    pub other_ratio: f64,
    pub temperature: f32,
    /// The prompts' category (the base sweep's), or None for all of the cell's prompts.
    pub category: Option<String>,
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

/// The base sweep's ratio paired with the other's (`compare --pair`), as reports print ratios (4 decimals).
pub type RatioPair = (f64, f64);

/// A ratio of `runs` that prints as `wanted` does (4 decimals), exactly as the sweep stored it.
fn stored_ratio(runs: &[RunCounts], wanted: f64, which: &str) -> Result<f64> {
    match runs.iter().find(|r| printed_ratio(r.ratio) == printed_ratio(wanted)) {
        Some(r) => Ok(r.ratio),
        None => {
            let mut held: Vec<f64> = runs.iter().map(|r| printed_ratio(r.ratio)).collect();
            held.sort_by(f64::total_cmp);
            held.dedup();
            bail!("--pair: the {which} sweep has no ratio {wanted} (it has {held:?})")
        }
    }
}

/// The cells compared: with no `pairs`, every cell the two sweeps share, in the base sweep's order; else each
/// pair's base ratio against its other ratio, at every temperature both hold there. Both sweeps must hold the same
/// prompts and repeats in each. `by_category` follows each cell's row with one per category of the base sweep's
/// prompts, in their order there: where a draft gains or loses (MT-Bench's coding against its humanities, say),
/// with intervals as wide as a tenth of the prompts gives.
pub fn compare(base: &[RunCounts], other: &[RunCounts], pairs: &[RatioPair], by_category: bool, b: Bootstrap) -> Result<Vec<Row>> {
    let ratio_pairs = match pairs {
        [] => base.iter().map(|r| (r.ratio, r.ratio)).collect(),
        _ => pairs.iter().map(|&(a, o)| Ok((stored_ratio(base, a, "base")?, stored_ratio(other, o, "other")?))).collect::<Result<Vec<_>>>()?,
    };
    let mut cells: Vec<(f64, f64, f32)> = Vec::new();
    for (a, o) in ratio_pairs {
        for r in base.iter().filter(|r| r.ratio == a) {
            let cell = (a, o, r.temperature);
            if !cells.contains(&cell) && other.iter().any(|x| (x.ratio, x.temperature) == (o, r.temperature)) {
                cells.push(cell);
            }
        }
    }
    if cells.is_empty() {
        bail!("the two sweeps share no cell (ratio and temperature)");
    }
    let cell = |runs: &[RunCounts], ratio: f64, t: f32| -> Vec<RunCounts> {
        runs.iter().filter(|r| r.ratio == ratio && r.temperature == t).cloned().collect()
    };
    let mut rows = Vec::new();
    for (ratio, other_ratio, t) in cells {
        let (a, o) = (cell(base, ratio, t), cell(other, other_ratio, t));
        let groups = match by_category {
            true => categories(&a).map_err(|e| anyhow!("ratio {} at T = {t}: {e}", label(ratio, other_ratio)))?,
            false => Vec::new(),
        };
        for (category, prompts) in std::iter::once((None, None)).chain(groups.into_iter().map(|(c, p)| (Some(c), Some(p)))) {
            let units = |runs: &[RunCounts]| -> Vec<Unit> {
                let kept = |r: &&RunCounts| prompts.as_ref().is_none_or(|p: &BTreeSet<String>| p.contains(&r.unit.prompt));
                runs.iter().filter(kept).map(|r| r.unit.clone()).collect()
            };
            let (a, o) = (units(&a), units(&o));
            let difference = paired_difference(&o, &a, Metric::MeanAcceptanceLength, b).map_err(|e| {
                let of = category.as_ref().map_or(String::new(), |c| format!(", category {c}"));
                anyhow!("ratio {} at T = {t}{of}: {e}", label(ratio, other_ratio))
            })?;
            let (better, worse, tied) = per_prompt(&a, &o);
            rows.push(Row {
                ratio,
                other_ratio,
                temperature: t,
                category,
                prompts: better + worse + tied,
                base: estimate(&a, Metric::MeanAcceptanceLength, b),
                other: estimate(&o, Metric::MeanAcceptanceLength, b),
                difference,
                rate_difference: paired_difference(&o, &a, Metric::AcceptanceRate, b)?,
                better,
                worse,
            });
        }
    }
    Ok(rows)
}

/// A cell's categories in the order their first prompts come, each with its prompts.
fn categories(cell: &[RunCounts]) -> Result<Vec<(String, BTreeSet<String>)>> {
    let mut groups: Vec<(String, BTreeSet<String>)> = Vec::new();
    for r in cell {
        let Some(category) = &r.category else {
            bail!("the base sweep names no category for question {} (its dataset has none)", r.unit.prompt);
        };
        match groups.iter_mut().find(|(c, _)| c == category) {
            Some((_, prompts)) => {
                prompts.insert(r.unit.prompt.clone());
            }
            None => groups.push((category.clone(), BTreeSet::from([r.unit.prompt.clone()]))),
        }
    }
    Ok(groups)
}

/// Prompts better, worse and the same in `other`; both hold the same prompts (checked before).
fn per_prompt(base: &[Unit], other: &[Unit]) -> (usize, usize, usize) {
    let (a, o) = (by_prompt(base, Metric::MeanAcceptanceLength), by_prompt(other, Metric::MeanAcceptanceLength));
    let count = |want: std::cmp::Ordering| a.iter().zip(&o).filter(|(x, y)| y.total_cmp(x) == want).count();
    (count(std::cmp::Ordering::Greater), count(std::cmp::Ordering::Less), count(std::cmp::Ordering::Equal))
}

/// A cell's ratio: one number, or the base's and the other's when `--pair` matched two.
fn label(ratio: f64, other_ratio: f64) -> String {
    match ratio == other_ratio {
        true => format!("{}", printed_ratio(ratio)),
        false => format!("{} vs {}", printed_ratio(ratio), printed_ratio(other_ratio)),
    }
}

/// The rows as a Markdown table, with a category column where rows are split by category.
pub fn table(rows: &[Row], base_name: &str, other_name: &str) -> String {
    let signed = |e: &Estimate, d: usize| format!("{:+.d$} [{:+.d$}, {:+.d$}]", e.value, e.bootstrap.lo, e.bootstrap.hi, d = d);
    let by_category = rows.iter().any(|r| r.category.is_some());
    let (category_head, category_rule) = if by_category { (" category |", "---|") } else { ("", "") };
    let mut out = format!(
        "| ratio | T |{category_head} prompts | mean acceptance length, {base_name} | mean acceptance length, {other_name} | paired difference | acceptance rate difference (points) | better / worse |\n|---:|---:|{category_rule}---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        let category = match by_category {
            true => format!(" {} |", r.category.as_deref().unwrap_or("all")),
            false => String::new(),
        };
        out += &format!(
            "| {} | {} |{category} {} | {} | {} | {} | {} | {} / {} |\n",
            label(r.ratio, r.other_ratio),
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
        RunCounts { ratio, temperature: 0.0, category: None, unit: Unit { prompt: prompt.into(), repeat: 0, counts } }
    }

    #[test]
    fn the_paired_difference_is_other_minus_base_over_the_shared_cells() {
        // Ratio 0 in both; ratio 0.5 only in the base. Base lengths 1.5 and 2.0 (pooled 1.75), other 2.0 and 2.0.
        let base = [run(0.0, "81", 10, 5), run(0.0, "82", 10, 10), run(0.5, "81", 10, 1)];
        let other = [run(0.0, "82", 10, 10), run(0.0, "81", 10, 10)];
        let rows = compare(&base, &other, &[], false, Bootstrap::default()).unwrap();
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
    fn rows_by_category_pair_each_category_s_prompts_after_the_whole_cell() {
        let of = |category: &str, r: RunCounts| RunCounts { category: Some(category.into()), ..r };
        // Writing: 81 gains 0.5 (1.5 -> 2.0), 82 stays; coding: 83 loses 0.5 (2.0 -> 1.5).
        let base = [of("writing", run(0.0, "81", 10, 5)), of("coding", run(0.0, "83", 10, 10)), of("writing", run(0.0, "82", 10, 10))];
        let other = [run(0.0, "81", 10, 10), run(0.0, "82", 10, 10), run(0.0, "83", 10, 5)];
        let rows = compare(&base, &other, &[], true, Bootstrap::default()).unwrap();
        let shown: Vec<(Option<&str>, usize, usize, usize)> = rows.iter().map(|r| (r.category.as_deref(), r.prompts, r.better, r.worse)).collect();
        assert_eq!(shown, [(None, 3, 1, 1), (Some("writing"), 2, 1, 0), (Some("coding"), 1, 0, 1)]);
        assert!((rows[1].difference.value - 0.25).abs() < 1e-12 && (rows[2].difference.value + 0.5).abs() < 1e-12, "{rows:?}");
        let table = table(&rows, "A", "B");
        assert!(table.contains("| ratio | T | category | prompts |") && table.contains("| 0 | 0 | all | 3 |"), "{table}");
        assert!(table.contains("| 0 | 0 | coding | 1 | 2.000 ["), "{table}");
        assert!(!super::table(&compare(&base, &other, &[], false, Bootstrap::default()).unwrap(), "A", "B").contains("category"));
        let e = compare(&other, &base, &[], true, Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("ratio 0 at T = 0: the base sweep names no category for question 81"), "{e}");
    }

    #[test]
    fn sweeps_of_other_prompts_do_not_compare() {
        let e = compare(&[run(0.0, "81", 10, 5)], &[run(0.0, "82", 10, 5)], &[], false, Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("ratio 0 at T = 0") && e.contains("same prompts"), "{e}");
        let e = compare(&[run(0.0, "81", 10, 5)], &[run(0.5, "81", 10, 5)], &[], false, Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("share no cell"), "{e}");
    }

    #[test]
    fn pairs_match_another_ratio_of_the_other_sweep_as_reports_print_it() {
        // The other sweep's ratio 5/6 stored in full; the base's ratio 0 pairs with it, as 0.8333 names it.
        let five_sixths = 1.0 - 8192.0 / 49152.0;
        let base = [run(0.0, "81", 10, 5), run(0.0, "82", 10, 10), run(0.5, "81", 10, 1), run(0.5, "82", 10, 1)];
        let other = [run(five_sixths, "81", 10, 10), run(five_sixths, "82", 10, 10)];
        let rows = compare(&base, &other, &[(0.0, 0.8333)], false, Bootstrap::default()).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].ratio, rows[0].other_ratio, rows[0].better, rows[0].worse), (0.0, five_sixths, 1, 0));
        assert!((rows[0].difference.value - 0.25).abs() < 1e-12, "{:?}", rows[0].difference);
        assert!(table(&rows, "A", "B").contains("| 0 vs 0.8333 | 0 | 2 |"), "{}", table(&rows, "A", "B"));
        let rows = compare(&base, &other, &[(0.5, 0.8333), (0.0, 0.8333)], false, Bootstrap::default()).unwrap();
        assert_eq!(rows.iter().map(|r| r.ratio).collect::<Vec<_>>(), [0.5, 0.0], "in the pairs' order");
        let e = compare(&base, &other, &[(0.0, 0.83)], false, Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("the other sweep has no ratio 0.83 (it has [0.8333])"), "{e}");
        let e = compare(&base, &other, &[(0.75, 0.8333)], false, Bootstrap::default()).unwrap_err().to_string();
        assert!(e.contains("the base sweep has no ratio 0.75 (it has [0.0, 0.5])"), "{e}");
    }
}
