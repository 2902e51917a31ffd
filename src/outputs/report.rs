//! The sweep's table, shaped like the seed thread's: pruning ratios as columns, one block of rows per
//! temperature (mean acceptance length, acceptance rate, their paired differences against the baseline, draft time
//! per step), each value with its 95% bootstrap interval over prompts.

use crate::stats::Estimate;
use crate::summary::{CellSummary, CellTiming};
use std::fmt::Write;

pub(crate) fn with_ci(e: &Estimate, decimals: usize) -> String {
    format!("{:.d$} [{:.d$}, {:.d$}]", e.value, e.bootstrap.lo, e.bootstrap.hi, d = decimals)
}

/// A ratio as tables print it: to 4 decimals (5/6 is 0.8333).
pub(crate) fn printed_ratio(ratio: f64) -> f64 {
    (ratio * 1e4).round() / 1e4
}

fn ratio_label(c: &CellSummary) -> String {
    if c.ratio == 0.0 {
        "vanilla".into()
    } else {
        format!("{}", printed_ratio(c.ratio))
    }
}

/// A plain-text table; `markdown` gives a Markdown table instead.
pub fn table(cells: &[CellSummary], timings: &[CellTiming], markdown: bool) -> String {
    let Some(first) = cells.first() else { return String::new() };
    let temperatures = crate::summary::temperatures(cells);
    let columns: Vec<&CellSummary> = cells.iter().filter(|c| c.temperature == first.temperature).collect();
    let baseline = crate::summary::ratio_name(first.baseline_ratio);
    let mut rows: Vec<(String, Vec<String>)> = vec![
        ("ratio".into(), columns.iter().map(|c| ratio_label(c)).collect()),
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
    let mut out = String::new();
    if markdown {
        let (head, rest) = rows.split_first().expect("the ratio row");
        let _ = writeln!(out, "| {} | {} |", head.0, head.1.join(" | "));
        let _ = writeln!(out, "|---|{}", "---:|".repeat(head.1.len()));
        for (name, values) in rest {
            let _ = writeln!(out, "| {name} | {} |", values.join(" | "));
        }
        return out;
    }
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
