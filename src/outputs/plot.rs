//! Plots of a sweep folder, as PNG and SVG in DIR/plots/: acceptance length and rate against the pruning ratio with
//! 95% bands, per-position acceptance, the paired difference against the baseline, and draft / LM-head time. The
//! font ships inside the binary (DejaVu Sans), so no system font library is needed.

use crate::stats::Estimate;
use crate::summary::{temperatures, CellSummary, CellTiming};
use anyhow::{anyhow, Result};
use plotters::chart::MeshStyle;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (1000, 640);
const RATIO_AXIS: &str = "pruning ratio (share of the vocabulary dropped from the draft head)";

fn font_once() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular()).is_ok());
    ok.then_some(()).ok_or_else(|| anyhow!("the embedded DejaVu Sans font could not be registered"))
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing failed: {e:?}")
}

/// What the titles say about the sweep.
pub struct Labels {
    pub title: String,
}

/// One line with a band: (x, estimate) points.
struct Series {
    name: String,
    points: Vec<(f64, Estimate)>,
}

fn by_temperature(cells: &[CellSummary], metric: fn(&CellSummary) -> &Estimate) -> Vec<Series> {
    temperatures(cells)
        .into_iter()
        .map(|t| Series {
            name: format!("T = {t}"),
            points: cells.iter().filter(|c| c.temperature == t).map(|c| (c.ratio, *metric(c))).collect(),
        })
        .collect()
}

fn range(values: impl Iterator<Item = f64>, include_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if include_zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    if lo > hi {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.08).max(1e-3);
    (lo - pad, hi + pad)
}

/// How one panel is drawn.
struct Panel<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    /// Draw y = 0 (differences).
    zero_line: bool,
    /// Mark the x = 0 points as vanilla.
    mark_vanilla: bool,
    /// Start the x axis at 0 (ratios) rather than at the data (positions).
    x_from_zero: bool,
    /// The x values are whole numbers (draft positions): label those only.
    whole_x: bool,
}

impl Panel<'_> {
    fn against_ratio<'a>(title: &'a str, x_label: &'a str, y_label: &'a str) -> Panel<'a> {
        Panel { title, x_label, y_label, zero_line: false, mark_vanilla: false, x_from_zero: true, whole_x: false }
    }
}

/// Lines with their 95% bootstrap bands.
fn bands<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel, series: &[Series]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let (title, x_label, y_label) = (panel.title, panel.x_label, panel.y_label);
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_lo, x_hi) = range(xs, panel.x_from_zero);
    let ys = series.iter().flat_map(|s| s.points.iter().flat_map(|(_, e)| [e.bootstrap.lo, e.bootstrap.hi, e.value]));
    let (y_lo, y_hi) = range(ys, panel.zero_line);
    let mut chart = builder(area, title).build_cartesian_2d(x_lo..x_hi, y_lo..y_hi).map_err(err)?;
    let whole = |v: &f64| if v.fract() == 0.0 { format!("{v}") } else { String::new() };
    let mut mesh = chart.configure_mesh();
    axes(&mut mesh, x_label, y_label);
    if panel.whole_x {
        mesh.x_labels((x_hi - x_lo).floor() as usize + 1).x_label_formatter(&whole);
    }
    mesh.draw().map_err(err)?;
    if panel.zero_line {
        chart.draw_series(LineSeries::new([(x_lo, 0.0), (x_hi, 0.0)], BLACK.stroke_width(1))).map_err(err)?;
    }
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut band: Vec<(f64, f64)> = s.points.iter().map(|(x, e)| (*x, e.bootstrap.hi)).collect();
        band.extend(s.points.iter().rev().map(|(x, e)| (*x, e.bootstrap.lo)));
        chart.draw_series(std::iter::once(Polygon::new(band, color.mix(0.18).filled()))).map_err(err)?;
        chart
            .draw_series(LineSeries::new(s.points.iter().map(|(x, e)| (*x, e.value)), color.stroke_width(2)))
            .map_err(err)?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(s.points.iter().map(|(x, e)| Circle::new((*x, e.value), 3, color.filled()))).map_err(err)?;
        if panel.mark_vanilla {
            let vanilla = s.points.iter().filter(|(x, _)| *x == 0.0);
            chart
                .draw_series(vanilla.map(|(x, e)| {
                    EmptyElement::at((*x, e.value)) + Circle::new((0, 0), 7, color.stroke_width(2)) + Text::new("vanilla", (10, -16), ("sans-serif", 14))
                }))
                .map_err(err)?;
        }
    }
    legend(&mut chart, SeriesLabelPosition::LowerLeft)
}

/// A chart with the common caption, margin and room for the axis labels.
fn builder<'a, 'b, DB: DrawingBackend>(area: &'a DrawingArea<DB, Shift>, caption: &str) -> ChartBuilder<'a, 'b, DB> {
    let mut b = ChartBuilder::on(area);
    b.caption(caption, ("sans-serif", 20)).margin(14).x_label_area_size(48).y_label_area_size(72);
    b
}

/// Axis descriptions and the common fonts.
fn axes<'m, 'a, 'b, X: Ranged, Y: Ranged, DB: DrawingBackend>(
    mesh: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
    x_label: &str,
    y_label: &str,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB> {
    mesh.x_desc(x_label).y_desc(y_label).axis_desc_style(("sans-serif", 16)).label_style(("sans-serif", 14))
}

/// The series' legend box at `position`.
fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(chart: &mut ChartContext<'a, DB, CT>, position: SeriesLabelPosition) -> Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(position)
        .draw()
        .map_err(err)
}

/// The charts of one sweep, each drawn on any backend.
struct Charts<'a> {
    cells: &'a [CellSummary],
    timings: &'a [CellTiming],
    labels: &'a Labels,
}

/// One named chart of a sweep.
struct Chart<'a> {
    charts: &'a Charts<'a>,
    name: &'static str,
}

impl Figure for Chart<'_> {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        self.charts.draw(self.name, area)
    }
}

impl Charts<'_> {
    fn draw<DB: DrawingBackend>(&self, name: &str, area: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let body = page(area, &self.labels.title)?;
        let baseline = self.cells.first().map_or(0.0, |c| c.baseline_ratio);
        let base = crate::summary::ratio_name(baseline);
        match name {
            "acceptance_length" => bands(
                &body,
                &Panel {
                    mark_vanilla: true,
                    ..Panel::against_ratio("Mean acceptance length (95% bootstrap band over prompts)", RATIO_AXIS, "tokens per drafting step")
                },
                &by_temperature(self.cells, |c| &c.length),
            ),
            "acceptance_rate" => bands(
                &body,
                &Panel {
                    mark_vanilla: true,
                    ..Panel::against_ratio("Acceptance rate (95% bootstrap band over prompts)", RATIO_AXIS, "accepted / draft tokens (%)")
                },
                &by_temperature(self.cells, |c| &c.rate),
            ),
            "paired_difference" => {
                let title = format!("Mean acceptance length minus {base}'s, paired over prompts (95% band)");
                let panel = Panel { zero_line: true, ..Panel::against_ratio(&title, RATIO_AXIS, "Δ tokens per drafting step") };
                bands(&body, &panel, &by_temperature(self.cells, |c| &c.length_diff))
            }
            "per_position" => {
                let temps = temperatures(self.cells);
                let panels = body.split_evenly((1, temps.len().max(1)));
                for (t, panel) in temps.iter().zip(&panels) {
                    let series: Vec<Series> = self
                        .cells
                        .iter()
                        .filter(|c| c.temperature == *t)
                        .map(|c| Series {
                            name: crate::summary::ratio_name(c.ratio),
                            points: c.per_position.iter().enumerate().map(|(i, e)| ((i + 1) as f64, *e)).collect(),
                        })
                        .collect();
                    let title = format!("T = {t}: steps accepting ≥ i drafts");
                    let p = Panel { x_from_zero: false, whole_x: true, ..Panel::against_ratio(&title, "draft position i", "share of drafting steps") };
                    bands(panel, &p, &series)?;
                }
                Ok(())
            }
            "draft_time" => {
                let (left, right) = body.split_horizontally(SIZE.0 / 2);
                let point = |t: &CellTiming, v: f64| flat(t.ratio, v);
                let temps = temperatures(self.cells);
                let per_step: Vec<Series> = temps
                    .iter()
                    .map(|t| Series {
                        name: format!("T = {t}"),
                        points: self.timings.iter().filter(|x| x.temperature == *t).map(|x| point(x, x.draft_ms_per_step)).collect(),
                    })
                    .collect();
                bands(&left, &Panel::against_ratio("Draft time per drafting step", "pruning ratio", "ms per step (k drafts)"), &per_step)?;
                let head: Vec<Series> = vec![Series {
                    name: "draft LM head, one row".into(),
                    points: self.timings.iter().filter(|x| x.temperature == temps[0]).filter_map(|x| x.head_ms.map(|h| point(x, h))).collect(),
                }];
                bands(&right, &Panel::against_ratio("Draft LM-head time (median of repeated calls)", "pruning ratio", "ms per call"), &head)
            }
            other => Err(anyhow!("no chart named {other}")),
        }
    }
}

fn flat(x: f64, v: f64) -> (f64, Estimate) {
    (x, Estimate { value: v, bootstrap: crate::stats::Interval { lo: v, hi: v }, t: None })
}

/// Moving average over the last `window` steps, against the step.
fn smoothed(log: &[crate::train::StepLog], window: usize, f: impl Fn(&crate::train::StepLog) -> f64) -> Vec<(f64, Estimate)> {
    (0..log.len())
        .map(|i| {
            let from = (i + 1).saturating_sub(window);
            let mean = log[from..=i].iter().map(&f).sum::<f64>() / (i + 1 - from) as f64;
            flat(log[i].step as f64, mean)
        })
        .collect()
}

/// Something drawn on any plotters backend.
trait Figure {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static;
}

/// `figure` as `{stem}.png` and `{stem}.svg`.
fn write_both<F: Figure>(stem: &Path, figure: &F) -> Result<[PathBuf; 2]> {
    let (png, svg) = (stem.with_extension("png"), stem.with_extension("svg"));
    {
        let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
        figure.draw(root.clone())?;
        root.present().map_err(err)?;
    }
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        figure.draw(root.clone())?;
        root.present().map_err(err)?;
    }
    Ok([png, svg])
}

/// A page: a header line, then the chart.
fn page<DB: DrawingBackend>(area: DrawingArea<DB, Shift>, header_text: &str) -> Result<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(err)?;
    let (header, body) = area.split_vertically(34);
    header.draw_text(header_text, &("sans-serif", 15).into_text_style(&header), (14, 10)).map_err(err)?;
    Ok(body)
}

struct TrainingCurve<'a> {
    log: &'a [crate::train::StepLog],
    title: &'a str,
    settings: &'a crate::train::TrainSettings,
}

impl Figure for TrainingCurve<'_> {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let weighted = |name: String, w: f64, part: fn(&crate::train::StepLog) -> f64| Series {
            name,
            points: smoothed(self.log, 25, part).into_iter().map(|(x, e)| flat(x, w * e.value)).collect(),
        };
        let (fw, cw) = (self.settings.feature_weight, self.settings.classification_weight);
        let losses = [
            Series { name: "total loss".into(), points: smoothed(self.log, 25, |l| l.loss) },
            weighted(format!("{fw} × smooth-L1 (features)"), fw, |l| l.regression),
            weighted(format!("{cw} × cross-entropy (tokens)"), cw, |l| l.classification),
        ];
        let mut top1 = vec![Series { name: "head argmax = target argmax (true features)".into(), points: smoothed(self.log, 25, |l| 100.0 * l.top1) }];
        let unrolled = self.log.iter().map(|l| l.unrolled_top1.len()).min().unwrap_or(0);
        for j in 0..unrolled {
            let own = move |l: &crate::train::StepLog| 100.0 * l.unrolled_top1[j];
            top1.push(Series { name: format!("… draft {} of a chain, fed its own features", j + 2), points: smoothed(self.log, 25, own) });
        }
        let body = page(area, self.title)?;
        let (left, right) = body.split_horizontally(SIZE.0 / 2);
        let panel = |t, y| Panel { x_from_zero: false, ..Panel::against_ratio(t, "optimisation step", y) };
        bands(&left, &panel("Training loss (25-step moving average)", "loss"), &losses)?;
        bands(&right, &panel("Top-1 agreement on answer positions", "% of positions"), &top1)
    }
}

/// The training curve of an EAGLE head (moving averages over 25 steps) as `{stem}.png` and `{stem}.svg`.
pub fn training_curve(stem: &Path, log: &[crate::train::StepLog], title: &str, settings: &crate::train::TrainSettings) -> Result<()> {
    font_once()?;
    write_both(stem, &TrainingCurve { log, title, settings }).map(|_| ())
}

struct HeadLatency<'a> {
    points: &'a [crate::bench::HeadPoint],
    title: &'a str,
}

impl Figure for HeadLatency<'_> {
    fn draw<DB: DrawingBackend>(&self, area: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let body = page(area, self.title)?;
        let ms: Vec<f64> = self.points.iter().map(|p| 1e3 * p.median_secs).collect();
        let (lo, hi) = (ms.iter().cloned().fold(f64::MAX, f64::min), ms.iter().cloned().fold(0.0, f64::max));
        let max_batch = self.points.iter().map(|p| p.batch).max().unwrap_or(1) as f64;
        let mut chart = builder(&body, "Draft LM-head latency [B, H] × [H, V′] (median)")
            .build_cartesian_2d((0.8f64..max_batch * 1.25).log_scale(), (lo * 0.8..hi * 1.25).log_scale())
            .map_err(err)?;
        axes(&mut chart.configure_mesh(), "batch B (rows of hidden states)", "milliseconds")
            .light_line_style(WHITE)
            .x_label_formatter(&|v| format!("{}", v.round()))
            .y_label_formatter(&|v| {
                let digits = (-(v.abs().log10().floor()) as i32).max(0) as usize;
                format!("{v:.digits$}")
            })
            .draw()
            .map_err(err)?;
        let mut kept: Vec<usize> = self.points.iter().map(|p| p.kept).collect();
        kept.dedup();
        for (i, k) in kept.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let line: Vec<(f64, f64)> = self.points.iter().filter(|p| p.kept == *k).map(|p| (p.batch as f64, 1e3 * p.median_secs)).collect();
            let ratio = self.points.iter().find(|p| p.kept == *k).map_or(0.0, |p| p.ratio);
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(format!("V′ = {k} (ratio {ratio})"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)
    }
}

/// The head benchmark's latency against batch, one line per keep size, as `{stem}.png` and `{stem}.svg`.
pub fn head_latency(stem: &Path, points: &[crate::bench::HeadPoint], title: &str) -> Result<()> {
    font_once()?;
    write_both(stem, &HeadLatency { points, title }).map(|_| ())
}

pub const CHARTS: [&str; 5] = ["acceptance_length", "acceptance_rate", "per_position", "paired_difference", "draft_time"];

/// Write every chart as PNG and SVG into `dir`; returns the files written.
pub fn write(dir: &Path, cells: &[CellSummary], timings: &[CellTiming], labels: &Labels) -> Result<Vec<PathBuf>> {
    font_once()?;
    if cells.is_empty() {
        return Err(anyhow!("the sweep has no cells to plot"));
    }
    std::fs::create_dir_all(dir).map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
    let charts = Charts { cells, timings, labels };
    let mut written = Vec::new();
    for name in CHARTS {
        written.extend(write_both(&dir.join(name), &Chart { charts: &charts, name })?);
    }
    Ok(written)
}
