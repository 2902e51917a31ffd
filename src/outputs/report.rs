//! The sweep's table, shaped like the seed thread's: pruning ratios as columns, one block of rows per
//! temperature (mean acceptance length, acceptance rate, their paired differences against the baseline, draft time
//! per step), each value with its 95% bootstrap interval over prompts.

use super::store::RunCounts;
use crate::stats::{estimate, paired_difference, Bootstrap, Estimate, Metric, Unit};
use crate::summary::{firsts, CellSummary, CellTiming};
use anyhow::Result;
use std::fmt::Write;

pub(crate) fn with_ci(e: &Estimate, decimals: usize) -> String {
    format!("{:.d$} [{:.d$}, {:.d$}]", e.value, e.bootstrap.lo, e.bootstrap.hi, d = decimals)
}

/// A ratio as tables print it: to 4 decimals (5/6 is 0.8333).
pub(crate) fn printed_ratio(ratio: f64) -> f64 {
    (ratio * 1e4).round() / 1e4
}

fn ratio_label(ratio: f64) -> String {
    if ratio == 0.0 {
        "vanilla".into()
    } else {
        format!("{}", printed_ratio(ratio))
    }
}

/// A plain-text table; `markdown` gives a Markdown table instead.
pub fn table(cells: &[CellSummary], timings: &[CellTiming], markdown: bool) -> String {
    let Some(first) = cells.first() else { return String::new() };
    let temperatures = crate::summary::temperatures(cells);
    let columns: Vec<&CellSummary> = cells.iter().filter(|c| c.temperature == first.temperature).collect();
    let baseline = crate::summary::ratio_name(first.baseline_ratio);
    let mut rows: Vec<(String, Vec<String>)> = vec![
        ("ratio".into(), columns.iter().map(|c| ratio_label(c.ratio)).collect()),
        ("kept ids".into(), columns.iter().map(|c| c.kept.to_string()).collect()),
    ];
    for &t in &temperatures {
        let at: Vec<&CellSummary> = cells.iter().filter(|c| c.temperature == t).collect();
        let timing = |c: &CellSummary| timings.iter().find(|x| x.temperature == c.temperature && x.ratio == c.ratio);
        rows.push((format!("T={t} mean acceptance length"), at.iter().map(|c| with_ci(&c.length, 3)).collect()));
        rows.push((format!("T={t} Δ length vs {baseline}"), at.iter().map(|c| with_ci(&c.length_diff, 3)).collect()));
        rows.push((format!("T={t} acceptance rate %"), at.iter().map(|c| with_ci(&c.rate, 1)).collect()));
        rows.push((format!("T={t} Δ rate vs {baseline} (points)"), at.iter().map(|c| with_ci(&c.rate_diff, 1)).collect()));
        rows.push((
            format!("T={t} draft ms per step"),
            at.iter().map(|c| timing(c).map_or("-".into(), |x| format!("{:.2}", x.draft_ms_per_step))).collect(),
        ));
    }
    if markdown {
        return markdown_table(&rows);
    }
    let mut out = String::new();
    let name_width = rows.iter().map(|(n, _)| n.chars().count()).max().unwrap_or(0);
    let width = rows.iter().flat_map(|(_, v)| v.iter().map(|s| s.chars().count())).max().unwrap_or(0);
    for (name, values) in &rows {
        let _ = write!(out, "{name:<name_width$}");
        for v in values {
            let _ = write!(out, "  {v:>width$}");
        }
        out.push('\n');
    }
    out
}

/// Named rows as a Markdown table, the first row its head.
fn markdown_table(rows: &[(String, Vec<String>)]) -> String {
    let mut out = String::new();
    let (head, rest) = rows.split_first().expect("a head row");
    let _ = writeln!(out, "| {} | {} |", head.0, head.1.join(" | "));
    let _ = writeln!(out, "|---|{}", "---:|".repeat(head.1.len()));
    for (name, values) in rest {
        let _ = writeln!(out, "| {name} | {} |", values.join(" | "));
    }
    out
}

/// Mean acceptance length per category of the dataset's prompts (MT-Bench's eight) at every ratio and temperature,
/// with its paired difference against the smallest ratio over that category's prompts: which kinds of request pay
/// for pruning (code, whose tokens a keep set counted on prose drops first, say). A Markdown table; None where the
/// runs name no category. Each category holds a tenth of MT-Bench's prompts, so its intervals are wide.
pub fn category_table(runs: &[RunCounts], b: Bootstrap) -> Result<Option<String>> {
    if runs.is_empty() || runs.iter().any(|r| r.category.is_none()) {
        return Ok(None);
    }
    let (temperatures, categories) = (firsts(runs.iter().map(|r| r.temperature)), firsts(runs.iter().filter_map(|r| r.category.as_deref())));
    let mut ratios: Vec<f64> = runs.iter().map(|r| r.ratio).collect();
    ratios.sort_by(f64::total_cmp);
    ratios.dedup();
    let baseline = crate::summary::ratio_name(ratios[0]);
    let mut rows = vec![("ratio".to_string(), ratios.iter().map(|&r| ratio_label(r)).collect())];
    for &t in &temperatures {
        for &category in &categories {
            let units = |ratio: f64| -> Vec<Unit> {
                let of = |r: &&RunCounts| r.ratio == ratio && r.temperature == t && r.category.as_deref() == Some(category);
                runs.iter().filter(of).map(|r| r.unit.clone()).collect()
            };
            let base = units(ratios[0]);
            let (mut lengths, mut diffs) = (Vec::new(), Vec::new());
            for &ratio in &ratios {
                let us = units(ratio);
                lengths.push(with_ci(&estimate(&us, Metric::MeanAcceptanceLength, b), 3));
                let diff = paired_difference(&us, &base, Metric::MeanAcceptanceLength, b)
                    .map_err(|e| anyhow::anyhow!("category {category} at ratio {} and T = {t}: {e}", printed_ratio(ratio)))?;
                diffs.push(with_ci(&diff, 3));
            }
            rows.push((format!("T={t} {category} mean acceptance length"), lengths));
            rows.push((format!("T={t} {category} Δ length vs {baseline}"), diffs));
        }
    }
    Ok(Some(markdown_table(&rows)))
}

/// One line naming what a sweep measured, from its manifest.
pub fn title(manifest: &serde_json::Value) -> String {
    let s = &manifest["settings"];
    let text = |key: &str| s[key].as_str().unwrap_or("-").to_string();
    let draft = match s["draft"].as_str() {
        Some(d) => format!("{} {d}", text("draft_kind")),
        None => text("draft_kind"),
    };
    format!("{} · draft {draft} · freq {} · {} · k = {}", text("model"), text("freq"), text("dataset"), s["k"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Counts;

    fn run(ratio: f64, category: Option<&str>, prompt: &str, accepted: u64) -> RunCounts {
        let counts = Counts { drafts: 10, draft_tokens: 40, accepted, expected_accepted: accepted as f64, accepted_per_pos: vec![] };
        RunCounts { ratio, temperature: 0.0, category: category.map(String::from), unit: Unit { prompt: prompt.into(), repeat: 0, counts } }
    }

    #[test]
    fn categories_get_their_own_lengths_and_paired_differences_against_the_smallest_ratio() {
        // Coding (81) loses 5 of 10 accepted tokens at ratio 0.5; writing (82, 83) loses none.
        let (w, c) = (Some("writing"), Some("coding"));
        let runs = [
            run(0.5, w, "82", 10),
            run(0.0, w, "82", 10),
            run(0.0, c, "81", 10),
            run(0.5, c, "81", 5),
            run(0.0, w, "83", 4),
            run(0.5, w, "83", 4),
        ];
        let table = category_table(&runs, Bootstrap::default()).unwrap().unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "| ratio | vanilla | 0.5 |", "{table}");
        assert!(lines[2].starts_with("| T=0 writing mean acceptance length | 1.700 [") && lines[3].starts_with("| T=0 writing Δ length vs vanilla | 0.000 ["), "{table}");
        assert!(lines[5].starts_with("| T=0 coding Δ length vs vanilla | 0.000 [0.000, 0.000] | -0.500 [-0.500, -0.500] |"), "{table}");
        assert_eq!(lines.len(), 6, "{table}");
        let mut unnamed = runs.to_vec();
        unnamed[4].category = None;
        assert!(category_table(&unnamed, Bootstrap::default()).unwrap().is_none(), "a run without a category: no table");
    }
}
