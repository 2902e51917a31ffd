//! Acceptance regression verdicts: a current sweep against a baseline sweep, cell by cell (ratio × temperature).
//! A cell regresses when its value falls below the baseline's by more than the larger of the tolerance and what the
//! two confidence intervals allow. Inputs that cannot be compared (other settings, other input files, missing
//! cells, unreadable files) are an error of their own, distinct from a regression.

use crate::outputs::manifest::Manifest;
use crate::stats::Estimate;
use crate::outputs::store;
use crate::summary::CellSummary;
use anyhow::{anyhow, bail, Context, Result};
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// The metrics a check can watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckMetric {
    MeanAcceptanceLength,
    AcceptanceRate,
    RbMeanAcceptanceLength,
    RbAcceptanceRate,
}

impl CheckMetric {
    fn of(self, c: &CellSummary) -> &Estimate {
        match self {
            CheckMetric::MeanAcceptanceLength => &c.length,
            CheckMetric::AcceptanceRate => &c.rate,
            CheckMetric::RbMeanAcceptanceLength => &c.rb_length,
            CheckMetric::RbAcceptanceRate => &c.rb_rate,
        }
    }

    fn name(self) -> &'static str {
        match self {
            CheckMetric::MeanAcceptanceLength => "mean acceptance length",
            CheckMetric::AcceptanceRate => "acceptance rate %",
            CheckMetric::RbMeanAcceptanceLength => "RB mean acceptance length",
            CheckMetric::RbAcceptanceRate => "RB acceptance rate %",
        }
    }
}

/// A sweep as a check reads it: its folder's summary.parquet and manifest.json.
pub struct SweepResult {
    pub dir: PathBuf,
    pub cells: Vec<CellSummary>,
    pub manifest: serde_json::Value,
}

impl SweepResult {
    pub fn load(dir: &Path) -> Result<SweepResult> {
        let summary = dir.join(store::SUMMARY);
        if !summary.exists() {
            bail!("{} holds no {}: is it a sweep folder?", dir.display(), store::SUMMARY);
        }
        let cells = store::read_summary(&summary)?;
        let manifest_path = dir.join(Manifest::FILE);
        let text = std::fs::read_to_string(&manifest_path).with_context(|| format!("cannot read {}", manifest_path.display()))?;
        let manifest: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| anyhow!("{} is not valid JSON: {e}", manifest_path.display()))?;
        if !manifest["settings"].is_object() || !manifest["files"].is_object() {
            bail!("{}: `settings` and `files` must be objects; it is not a frspec manifest", manifest_path.display());
        }
        Ok(SweepResult { dir: dir.to_path_buf(), cells, manifest })
    }

    /// The folder's timing_summary.parquet (plots and reports show time beside acceptance).
    pub fn timings(&self) -> Result<Vec<crate::summary::CellTiming>> {
        store::read_timing_summary(&self.dir.join(store::TIMING_SUMMARY))
    }

    fn cell(&self, ratio: f64, temperature: f32) -> Option<&CellSummary> {
        self.cells.iter().find(|c| c.ratio == ratio && c.temperature == temperature)
    }
}

/// Settings that define what is measured; seeds, repeats and the set of cells may differ between the two sweeps.
/// Model, draft, frequency file and dataset are compared by content (sha256), not by the path or name that led
/// to them, so a baseline made in one checkout checks a sweep made in another.
const SAME_SETTINGS: [&str; 8] = ["draft_kind", "num_prompts", "categories", "turns", "max_new_tokens", "k", "top_p", "draft_mode"];

/// Input files every sweep has: a manifest without their digests cannot say what it measured.
const REQUIRED_FILES: [&str; 2] = ["model", "dataset"];

/// What a manifest lacks to be compared at all: a setting `check` compares, or a digest of an input file. Two
/// manifests that lacked the same field would otherwise compare equal.
fn lacking(r: &SweepResult) -> Vec<String> {
    let m = &r.manifest;
    let settings = SAME_SETTINGS.iter().filter(|k| m["settings"].get(**k).is_none()).map(|k| format!("settings.{k}"));
    let mut roles: std::collections::BTreeSet<String> = REQUIRED_FILES.iter().map(|r| r.to_string()).collect();
    roles.extend(m["files"].as_object().into_iter().flat_map(|f| f.keys().cloned()));
    let digests = roles.into_iter().filter(|role| !m["files"][role]["sha256"].is_string()).map(|role| format!("files.{role}.sha256"));
    settings.chain(digests).collect()
}

/// Why two sweeps cannot be compared, or None.
fn incomparable(base: &SweepResult, cur: &SweepResult) -> Vec<String> {
    let mut out = Vec::new();
    for key in SAME_SETTINGS {
        let (a, b) = (&base.manifest["settings"][key], &cur.manifest["settings"][key]);
        if a != b {
            out.push(format!("{key}: baseline {a}, current {b}"));
        }
    }
    // The candle engine writes its batch size into the settings (its records may depend on it): two of its sweeps
    // compare at the same batch only. A CPU-engine sweep (records independent of the batch) compares with either.
    if let (Some(a), Some(b)) = (base.manifest["settings"].get("batch"), cur.manifest["settings"].get("batch")) {
        if a != b {
            out.push(format!("batch: baseline {a}, current {b}"));
        }
    }
    let roles = |m: &serde_json::Value| m["files"].as_object().map(|f| f.keys().cloned().collect::<std::collections::BTreeSet<_>>()).unwrap_or_default();
    for role in roles(&base.manifest).union(&roles(&cur.manifest)) {
        if cur.manifest["files"][role]["sha256"] != base.manifest["files"][role]["sha256"] {
            out.push(format!("the {role} file differs (sha256)"));
        }
    }
    out
}

#[derive(Clone, Debug)]
pub struct Row {
    pub ratio: f64,
    pub temperature: f32,
    pub metric: CheckMetric,
    pub baseline: Estimate,
    pub current: Estimate,
    /// The largest drop that still passes.
    pub allowed: f64,
    pub regressed: bool,
}

impl Row {
    pub fn change(&self) -> f64 {
        self.current.value - self.baseline.value
    }
}

/// Compare every baseline cell with the current one. `tolerance` is relative to the baseline value.
pub fn compare(base: &SweepResult, cur: &SweepResult, metrics: &[CheckMetric], tolerance: f64) -> Result<Vec<Row>> {
    if !(tolerance >= 0.0 && tolerance.is_finite()) {
        bail!("--tolerance must be a finite number ≥ 0, got {tolerance}");
    }
    for r in [base, cur] {
        let lacks = lacking(r);
        if !lacks.is_empty() {
            bail!("{}: its manifest lacks {}, so what it measured cannot be compared", r.dir.join(Manifest::FILE).display(), lacks.join(", "));
        }
    }
    let differences = incomparable(base, cur);
    if !differences.is_empty() {
        bail!("{} and {} were made with different settings: {}", base.dir.display(), cur.dir.display(), differences.join("; "));
    }
    let missing: Vec<String> = base
        .cells
        .iter()
        .filter(|c| cur.cell(c.ratio, c.temperature).is_none())
        .map(|c| format!("ratio {} at T={}", c.ratio, c.temperature))
        .collect();
    if !missing.is_empty() {
        bail!("{} lacks cells the baseline has: {}", cur.dir.display(), missing.join(", "));
    }
    let mut rows = Vec::new();
    for b in &base.cells {
        let c = cur.cell(b.ratio, b.temperature).expect("checked above");
        for &metric in metrics {
            let (be, ce) = (*metric.of(b), *metric.of(c));
            // The baseline's downside and the current's upside, combined as independent errors.
            let noise = (be.value - be.bootstrap.lo).hypot(ce.bootstrap.hi - ce.value);
            let allowed = noise.max(tolerance * be.value.abs());
            // Written so that a NaN anywhere (a value, an interval) counts as a regression, never as a pass.
            let regressed = !(be.value - ce.value <= allowed);
            rows.push(Row { ratio: b.ratio, temperature: b.temperature, metric, baseline: be, current: ce, allowed, regressed });
        }
    }
    Ok(rows)
}

pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:>5} {:>6} {:<26} {:>24} {:>24} {:>9} {:>9}  verdict", "T", "ratio", "metric", "baseline [95% CI]", "current [95% CI]", "change", "allowed");
    let ci = |e: &Estimate| format!("{:.3} [{:.3}, {:.3}]", e.value, e.bootstrap.lo, e.bootstrap.hi);
    for r in rows {
        let _ = writeln!(
            out,
            "{:>5} {:>6} {:<26} {:>24} {:>24} {:>+9.3} {:>9.3}  {}",
            r.temperature,
            r.ratio,
            r.metric.name(),
            ci(&r.baseline),
            ci(&r.current),
            r.change(),
            -r.allowed,
            if r.regressed { "REGRESSED" } else { "ok" }
        );
    }
    out
}

/// Make `current` the baseline: copy its summary and manifest into `baseline`.
pub fn update_baseline(baseline: &Path, current: &Path) -> Result<()> {
    SweepResult::load(current)?;
    std::fs::create_dir_all(baseline).with_context(|| format!("cannot create {}", baseline.display()))?;
    for file in [store::SUMMARY, Manifest::FILE] {
        let bytes = std::fs::read(current.join(file)).with_context(|| format!("cannot read {}", current.join(file).display()))?;
        crate::files::write_atomic(&baseline.join(file), &bytes)?;
    }
    Ok(())
}
