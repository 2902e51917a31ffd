//! A sweep's tables as Parquet (through polars), written atomically: a reader never sees half a file.
//!
//! runs.parquet and summary.parquet hold only what the seed determines, so the same sweep writes them byte for
//! byte again; every clock reading goes to timings.parquet (per run) and timing_summary.parquet (per cell).

use crate::stats::{Counts, Estimate, Interval, Unit};
use crate::summary::{CellSummary, CellTiming};
use crate::sweep::Run;
use anyhow::{anyhow, Context, Result};
use polars::prelude::{Column, DataFrame, DataType, NamedFrom, ParquetReader, ParquetWriter, PolarsResult, SerReader, Series};
use std::path::Path;

pub const RUNS: &str = "runs.parquet";
pub const SUMMARY: &str = "summary.parquet";
pub const TIMINGS: &str = "timings.parquet";
pub const TIMING_SUMMARY: &str = "timing_summary.parquet";

fn write_frame(path: &Path, columns: Vec<Column>) -> Result<()> {
    let height = columns.first().map_or(0, |c| c.len());
    let mut df = DataFrame::new(height, columns)?;
    let mut bytes = Vec::new();
    ParquetWriter::new(&mut bytes).finish(&mut df).with_context(|| format!("cannot encode {}", path.display()))?;
    crate::files::write_atomic(path, &bytes)
}

/// A Parquet file as a DataFrame, or one error naming the file.
pub fn read(path: &Path) -> Result<DataFrame> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    ParquetReader::new(file).finish().map_err(|e| anyhow!("{} is not a readable Parquet file: {e}", path.display()))
}

fn col<T, P: ?Sized>(name: &str, values: T) -> Column
where
    Series: NamedFrom<T, P>,
{
    Column::new(name.into(), values)
}

/// Rows of `runs` with `kept[i]` the head size of ratio `ratios[i]`, categories by prompt index.
pub fn write_runs(path: &Path, runs: &[Run], ratios: &[f64], kept: &[u64], categories: &[Option<String>], k: usize) -> Result<()> {
    let kept_of = |r: &Run| kept[ratios.iter().position(|&x| x == r.ratio).expect("a plan ratio")];
    let u64s = |f: &dyn Fn(&Run) -> u64| runs.iter().map(f).collect::<Vec<u64>>();
    let mut columns = vec![
        col("ratio", runs.iter().map(|r| r.ratio).collect::<Vec<f64>>()),
        col("kept", u64s(&kept_of)),
        col("temperature", runs.iter().map(|r| r.temperature).collect::<Vec<f32>>()),
        col("repeat", runs.iter().map(|r| r.repeat).collect::<Vec<u32>>()),
        col("prompt_index", runs.iter().map(|r| r.prompt_index).collect::<Vec<u32>>()),
        col("question_id", runs.iter().map(|r| r.prompt.clone()).collect::<Vec<String>>()),
        col("category", runs.iter().map(|r| categories[r.prompt_index as usize].clone()).collect::<Vec<Option<String>>>()),
        col("turn", runs.iter().map(|r| r.turn + 1).collect::<Vec<u32>>()),
        col("prompt_tokens", u64s(&|r| r.record.prompt_tokens as u64)),
        col("generated", u64s(&|r| r.record.generated as u64)),
        col("drafts", u64s(&|r| r.record.drafts)),
        col("draft_tokens", u64s(&|r| r.record.draft_tokens)),
        col("accepted", u64s(&|r| r.record.accepted)),
        col("expected_accepted", runs.iter().map(|r| r.record.expected_accepted).collect::<Vec<f64>>()),
    ];
    for i in 0..k {
        columns.push(col(&format!("accepted_pos{}", i + 1), u64s(&|r| r.record.accepted_per_pos.get(i).copied().unwrap_or(0))));
    }
    let stop = |r: &Run| r.record.stop.map(|s| serde_json::to_value(s).expect("an enum").as_str().expect("a name").to_string());
    columns.push(col("stop", runs.iter().map(stop).collect::<Vec<Option<String>>>()));
    write_frame(path, columns)
}

pub fn write_timings(path: &Path, runs: &[Run]) -> Result<()> {
    write_frame(
        path,
        vec![
            col("ratio", runs.iter().map(|r| r.ratio).collect::<Vec<f64>>()),
            col("temperature", runs.iter().map(|r| r.temperature).collect::<Vec<f32>>()),
            col("repeat", runs.iter().map(|r| r.repeat).collect::<Vec<u32>>()),
            col("prompt_index", runs.iter().map(|r| r.prompt_index).collect::<Vec<u32>>()),
            col("turn", runs.iter().map(|r| r.turn + 1).collect::<Vec<u32>>()),
            col("draft_secs", runs.iter().map(|r| r.record.draft_secs).collect::<Vec<f64>>()),
            col("target_secs", runs.iter().map(|r| r.record.target_secs).collect::<Vec<f64>>()),
        ],
    )
}

/// `{name}`, `{name}_boot_lo/hi` (bootstrap over prompts) and `{name}_t_lo/hi` (t over repeats; null with one).
fn estimate_columns(columns: &mut Vec<Column>, name: &str, values: &[&Estimate]) {
    columns.push(col(name, values.iter().map(|e| e.value).collect::<Vec<f64>>()));
    columns.push(col(&format!("{name}_boot_lo"), values.iter().map(|e| e.bootstrap.lo).collect::<Vec<f64>>()));
    columns.push(col(&format!("{name}_boot_hi"), values.iter().map(|e| e.bootstrap.hi).collect::<Vec<f64>>()));
    columns.push(col(&format!("{name}_t_lo"), values.iter().map(|e| e.t.map(|t| t.lo)).collect::<Vec<Option<f64>>>()));
    columns.push(col(&format!("{name}_t_hi"), values.iter().map(|e| e.t.map(|t| t.hi)).collect::<Vec<Option<f64>>>()));
}

pub fn write_summary(path: &Path, cells: &[CellSummary]) -> Result<()> {
    let u64s = |f: &dyn Fn(&CellSummary) -> u64| cells.iter().map(f).collect::<Vec<u64>>();
    let mut columns = vec![
        col("ratio", cells.iter().map(|c| c.ratio).collect::<Vec<f64>>()),
        col("kept", u64s(&|c| c.kept)),
        col("temperature", cells.iter().map(|c| c.temperature).collect::<Vec<f32>>()),
        col("prompts", cells.iter().map(|c| c.prompts).collect::<Vec<u32>>()),
        col("repeats", cells.iter().map(|c| c.repeats).collect::<Vec<u32>>()),
        col("runs", u64s(&|c| c.runs)),
        col("generated", u64s(&|c| c.generated)),
        col("drafts", u64s(&|c| c.counts.drafts)),
        col("draft_tokens", u64s(&|c| c.counts.draft_tokens)),
        col("accepted", u64s(&|c| c.counts.accepted)),
        col("expected_accepted", cells.iter().map(|c| c.counts.expected_accepted).collect::<Vec<f64>>()),
    ];
    let estimates = |f: fn(&CellSummary) -> &Estimate| cells.iter().map(f).collect::<Vec<&Estimate>>();
    estimate_columns(&mut columns, "mean_acceptance_length", &estimates(|c| &c.length));
    estimate_columns(&mut columns, "acceptance_rate", &estimates(|c| &c.rate));
    estimate_columns(&mut columns, "rb_mean_acceptance_length", &estimates(|c| &c.rb_length));
    estimate_columns(&mut columns, "rb_acceptance_rate", &estimates(|c| &c.rb_rate));
    let positions = cells.first().map_or(0, |c| c.per_position.len());
    for i in 0..positions {
        let at: Vec<&Estimate> = cells.iter().map(|c| &c.per_position[i]).collect();
        estimate_columns(&mut columns, &format!("accepted_pos{}", i + 1), &at);
    }
    columns.push(col("baseline_ratio", cells.iter().map(|c| c.baseline_ratio).collect::<Vec<f64>>()));
    estimate_columns(&mut columns, "mean_acceptance_length_diff", &estimates(|c| &c.length_diff));
    estimate_columns(&mut columns, "acceptance_rate_diff", &estimates(|c| &c.rate_diff));
    write_frame(path, columns)
}

pub fn write_timing_summary(path: &Path, cells: &[CellTiming]) -> Result<()> {
    let f64s = |f: fn(&CellTiming) -> f64| cells.iter().map(f).collect::<Vec<f64>>();
    write_frame(
        path,
        vec![
            col("ratio", f64s(|c| c.ratio)),
            col("kept", cells.iter().map(|c| c.kept).collect::<Vec<u64>>()),
            col("temperature", cells.iter().map(|c| c.temperature).collect::<Vec<f32>>()),
            col("generated", cells.iter().map(|c| c.generated).collect::<Vec<u64>>()),
            col("drafts", cells.iter().map(|c| c.drafts).collect::<Vec<u64>>()),
            col("draft_secs", f64s(|c| c.draft_secs)),
            col("target_secs", f64s(|c| c.target_secs)),
            col("draft_ms_per_step", f64s(|c| c.draft_ms_per_step)),
            col("tokens_per_sec", cells.iter().map(|c| c.tokens_per_sec).collect::<Vec<Option<f64>>>()),
            col("head_ms", cells.iter().map(|c| c.head_ms).collect::<Vec<Option<f64>>>()),
        ],
    )
}

/// A column of `df` (read from `path`) as values, or an error naming the file and column.
fn values<T>(df: &DataFrame, path: &Path, name: &str, get: impl Fn(&Column) -> PolarsResult<Vec<Option<T>>>) -> Result<Vec<Option<T>>> {
    let column = df.column(name).map_err(|_| anyhow!("{}: no column `{name}`", path.display()))?;
    get(column).map_err(|e| anyhow!("{}: column `{name}` has the wrong type: {e}", path.display()))
}

fn f64s(df: &DataFrame, path: &Path, name: &str) -> Result<Vec<Option<f64>>> {
    values(df, path, name, |c| Ok(c.cast(&DataType::Float64)?.f64()?.to_vec()))
}

fn u64s(df: &DataFrame, path: &Path, name: &str) -> Result<Vec<u64>> {
    let v = values(df, path, name, |c| Ok(c.cast(&DataType::UInt64)?.u64()?.to_vec()))?;
    v.into_iter().map(|x| x.ok_or_else(|| anyhow!("{}: column `{name}` has nulls", path.display()))).collect()
}

fn required(path: &Path, name: &str, v: Vec<Option<f64>>) -> Result<Vec<f64>> {
    v.into_iter().map(|x| x.ok_or_else(|| anyhow!("{}: column `{name}` has nulls", path.display()))).collect()
}

fn estimates(df: &DataFrame, path: &Path, name: &str) -> Result<Vec<Estimate>> {
    let req = |suffix: &str| -> Result<Vec<f64>> {
        let col = format!("{name}{suffix}");
        required(path, &col, f64s(df, path, &col)?)
    };
    let (value, lo, hi) = (req("")?, req("_boot_lo")?, req("_boot_hi")?);
    let (t_lo, t_hi) = (f64s(df, path, &format!("{name}_t_lo"))?, f64s(df, path, &format!("{name}_t_hi"))?);
    Ok((0..value.len())
        .map(|i| Estimate {
            value: value[i],
            bootstrap: Interval { lo: lo[i], hi: hi[i] },
            t: t_lo[i].zip(t_hi[i]).map(|(lo, hi)| Interval { lo, hi }),
        })
        .collect())
}

/// How many `accepted_pos{i}` columns a table has (one per draft position of its k).
fn position_columns(df: &DataFrame) -> usize {
    (1..).take_while(|i| df.column(&format!("accepted_pos{i}")).is_ok()).count()
}

/// One run of runs.parquet: its cell and its counts as a resampling unit.
#[derive(Clone, Debug)]
pub struct RunCounts {
    pub ratio: f64,
    pub temperature: f32,
    /// The dataset's category of the run's prompt, where it names one (MT-Bench's eight).
    pub category: Option<String>,
    pub unit: Unit,
}

/// runs.parquet back into counts per run (the per-position counts as far as the file has columns for them).
pub fn read_runs(path: &Path) -> Result<Vec<RunCounts>> {
    let df = read(path)?;
    let f = |name: &str| required(path, name, f64s(&df, path, name)?);
    let u = |name: &str| u64s(&df, path, name);
    let (ratio, temperature, repeat, expected) = (f("ratio")?, f("temperature")?, u("repeat")?, f("expected_accepted")?);
    let (drafts, draft_tokens, accepted) = (u("drafts")?, u("draft_tokens")?, u("accepted")?);
    let strings = |name: &str| values(&df, path, name, |c| Ok(c.cast(&DataType::String)?.str()?.iter().map(|s| s.map(String::from)).collect()));
    let question = strings("question_id")?;
    // Sweeps before categories were stored have no such column: their runs name none.
    let category = if df.column("category").is_ok() { strings("category")? } else { vec![None; df.height()] };
    let positions = (1..=position_columns(&df)).map(|i| u(&format!("accepted_pos{i}"))).collect::<Result<Vec<_>>>()?;
    (0..df.height())
        .map(|i| {
            let prompt = question[i].clone().ok_or_else(|| anyhow!("{}: column `question_id` has nulls", path.display()))?;
            let counts = Counts {
                drafts: drafts[i],
                draft_tokens: draft_tokens[i],
                accepted: accepted[i],
                expected_accepted: expected[i],
                accepted_per_pos: positions.iter().map(|p| p[i]).collect(),
            };
            let unit = Unit { prompt, repeat: repeat[i] as usize, counts };
            Ok(RunCounts { ratio: ratio[i], temperature: temperature[i] as f32, category: category[i].clone(), unit })
        })
        .collect()
}

/// summary.parquet back into cells.
pub fn read_summary(path: &Path) -> Result<Vec<CellSummary>> {
    let df = read(path)?;
    let f = |name: &str| required(path, name, f64s(&df, path, name)?);
    let u = |name: &str| u64s(&df, path, name);
    let (ratio, kept, temperature, prompts, repeats, runs, generated) =
        (f("ratio")?, u("kept")?, f("temperature")?, u("prompts")?, u("repeats")?, u("runs")?, u("generated")?);
    let (drafts, draft_tokens, accepted, expected) = (u("drafts")?, u("draft_tokens")?, u("accepted")?, f("expected_accepted")?);
    let est = |name: &str| estimates(&df, path, name);
    let (length, rate, rb_length, rb_rate) =
        (est("mean_acceptance_length")?, est("acceptance_rate")?, est("rb_mean_acceptance_length")?, est("rb_acceptance_rate")?);
    let (baseline, length_diff, rate_diff) = (f("baseline_ratio")?, est("mean_acceptance_length_diff")?, est("acceptance_rate_diff")?);
    let positions = position_columns(&df);
    let per_position = (1..=positions).map(|i| est(&format!("accepted_pos{i}"))).collect::<Result<Vec<_>>>()?;
    Ok((0..df.height())
        .map(|i| CellSummary {
            ratio: ratio[i],
            kept: kept[i],
            temperature: temperature[i] as f32,
            prompts: prompts[i] as u32,
            repeats: repeats[i] as u32,
            runs: runs[i],
            generated: generated[i],
            counts: Counts { drafts: drafts[i], draft_tokens: draft_tokens[i], accepted: accepted[i], expected_accepted: expected[i], accepted_per_pos: Vec::new() },
            length: length[i],
            rate: rate[i],
            rb_length: rb_length[i],
            rb_rate: rb_rate[i],
            per_position: per_position.iter().map(|p| p[i]).collect(),
            baseline_ratio: baseline[i],
            length_diff: length_diff[i],
            rate_diff: rate_diff[i],
        })
        .collect())
}

/// Head times, absent from tables written before they were measured.
fn head_ms(df: &DataFrame, path: &Path) -> Result<Vec<Option<f64>>> {
    match df.column("head_ms") {
        Ok(_) => f64s(df, path, "head_ms"),
        Err(_) => Ok(vec![None; df.height()]),
    }
}

/// timing_summary.parquet back into cells.
pub fn read_timing_summary(path: &Path) -> Result<Vec<CellTiming>> {
    let df = read(path)?;
    let f = |name: &str| required(path, name, f64s(&df, path, name)?);
    let u = |name: &str| u64s(&df, path, name);
    let (ratio, kept, temperature, generated, drafts) = (f("ratio")?, u("kept")?, f("temperature")?, u("generated")?, u("drafts")?);
    let (draft_secs, target_secs, per_step, tokens_per_sec, head_ms) =
        (f("draft_secs")?, f("target_secs")?, f("draft_ms_per_step")?, f64s(&df, path, "tokens_per_sec")?, head_ms(&df, path)?);
    Ok((0..df.height())
        .map(|i| CellTiming {
            ratio: ratio[i],
            kept: kept[i],
            temperature: temperature[i] as f32,
            generated: generated[i],
            drafts: drafts[i],
            draft_secs: draft_secs[i],
            target_secs: target_secs[i],
            draft_ms_per_step: per_step[i],
            tokens_per_sec: tokens_per_sec[i],
            head_ms: head_ms[i],
        })
        .collect())
}

/// The LM-head benchmark's points.
pub fn write_head_bench(path: &Path, points: &[crate::bench::HeadPoint]) -> Result<()> {
    let f64s = |f: fn(&crate::bench::HeadPoint) -> f64| points.iter().map(f).collect::<Vec<f64>>();
    write_frame(
        path,
        vec![
            col("ratio", f64s(|p| p.ratio)),
            col("kept", points.iter().map(|p| p.kept as u64).collect::<Vec<u64>>()),
            col("batch", points.iter().map(|p| p.batch as u64).collect::<Vec<u64>>()),
            col("dtype", points.iter().map(|p| p.dtype.clone()).collect::<Vec<String>>()),
            col("median_secs", f64s(|p| p.median_secs)),
            col("bytes", f64s(|p| p.bytes)),
            col("flops", f64s(|p| p.flops)),
            col("bytes_per_sec", f64s(|p| p.bytes_per_sec)),
            col("flops_per_sec", f64s(|p| p.flops_per_sec)),
            col("intensity", f64s(|p| p.intensity)),
            col("roofline_share", f64s(|p| p.roofline_share)),
        ],
    )
}
