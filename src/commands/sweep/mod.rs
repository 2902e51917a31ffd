//! `frspec sweep`, from settings to files: check and load everything first (bad input leaves no folder behind),
//! choose the engine, run the units the folder lacks (`crate::sweep`), then assemble runs.parquet, summary.parquet,
//! the timing tables and manifest.json from the folder's journal.

pub mod folder;
mod progress;

pub use folder::{FolderMode, Identity};

use crate::sweep::shard::{self, Shard};
use crate::sweep::{Engine, Observer, Plan, Run, UnitKey};
use folder::Folder;
use progress::Progress;
use crate::text::dataset::{self, Question};
use crate::engine::candle::draft::DraftWeights;
use crate::engine::{candle, cpu, EngineKind};
use crate::outputs::manifest::{self, FileDigest, Hardware, Manifest};
use crate::spec::{Pruning, Settings};
use crate::speculative::{Draft, DraftHead, DraftKind, HeadMode};
use crate::outputs::store;
use crate::summary::{self, CellSummary, CellTiming};
use crate::loading::target::Target;
use crate::text::tokenizer::Tokenizer;
use crate::vocab::{Frequencies, KeepRule, KeepSet};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Calls of each draft head timed for timing_summary.parquet.
const HEAD_REPS: usize = 200;

pub struct Options {
    pub mode: FolderMode,
    /// Plain progress lines even on a terminal.
    pub quiet: bool,
    /// The command line, for the manifest.
    pub command: Vec<String>,
}

pub struct Outcome {
    pub summary: Vec<CellSummary>,
    pub timings: Vec<CellTiming>,
    pub units_run: usize,
    pub units_resumed: usize,
}

/// The questions the settings select, in dataset order.
fn questions(settings: &Settings) -> Result<Vec<Question>> {
    let mut qs = dataset::load(&settings.dataset)?;
    if !settings.categories.is_empty() {
        let present: std::collections::BTreeSet<String> = qs.iter().filter_map(|q| q.category.clone()).collect();
        qs.retain(|q| q.category.as_ref().is_some_and(|c| settings.categories.contains(c)));
        if qs.is_empty() {
            let present: Vec<String> = present.into_iter().collect();
            bail!("dataset {} has no question of category {} (it has: {})", settings.dataset, settings.categories.join(", "), present.join(", "));
        }
    }
    match settings.num_prompts {
        Some(0) => bail!("num_prompts must be at least 1"),
        Some(n) if n > qs.len() => bail!("num_prompts is {n}, but dataset {} has {} matching questions", settings.dataset, qs.len()),
        Some(n) => qs.truncate(n),
        None => {}
    }
    Ok(qs)
}

fn plan(settings: &Settings, ratios: Vec<f64>) -> Plan {
    Plan {
        ratios,
        temperatures: settings.temperatures.clone(),
        top_p: settings.top_p,
        repeats: settings.repeats,
        seed: settings.seed,
        k: settings.k,
        turns: settings.turns,
        max_new_tokens: settings.max_new_tokens,
        mode: settings.draft_mode,
    }
}

/// Checks that need no model: everything a typo in a flag or sweep file can break.
fn check(settings: &Settings, questions: &[Question]) -> Result<()> {
    match settings.engine {
        EngineKind::Cpu if settings.device != "cpu" => bail!("device {}: the cpu engine runs on the CPU (use --engine candle for a GPU)", settings.device),
        EngineKind::Cpu if settings.dtype != "f32" => bail!("dtype {}: the cpu engine computes activations in f32 (use f32, or --engine candle)", settings.dtype),
        EngineKind::Cpu => {}
        EngineKind::Candle => {
            candle::dtype(&settings.dtype)?;
            candle::cuda_ordinal(&settings.device)?;
        }
    }
    let labels = match &settings.pruning {
        Pruning::Ratios(r) => r.clone(),
        Pruning::Keeps(keeps) => {
            if keeps.contains(&0) {
                bail!("keep sizes must be at least 1");
            }
            keeps.iter().map(|&k| -(k as f64)).collect()
        }
    };
    if let Some(i) = (1..labels.len()).find(|&i| labels[..i].contains(&labels[i])) {
        bail!("pruning cell {} appears twice in the sweep", labels[i].abs());
    }
    if let Some(i) = (1..settings.temperatures.len()).find(|&i| settings.temperatures[..i].contains(&settings.temperatures[i])) {
        bail!("temperature {} appears twice in the sweep", settings.temperatures[i]);
    }
    let ratios = match &settings.pruning {
        Pruning::Ratios(r) => r.clone(),
        Pruning::Keeps(k) => vec![0.0; k.len()],
    };
    plan(settings, ratios).validate(questions)
}

/// Keep rules, the ratio labels they stand for, given the target's vocabulary.
fn cells(settings: &Settings, vocab: usize) -> (Vec<KeepRule>, Vec<f64>) {
    match &settings.pruning {
        Pruning::Ratios(r) => (r.iter().map(|&r| KeepRule::Ratio(r)).collect(), r.clone()),
        Pruning::Keeps(k) => (k.iter().map(|&k| KeepRule::Keep(k)).collect(), k.iter().map(|&k| 1.0 - k as f64 / vocab as f64).collect()),
    }
}

fn digest(role: &str, path: &Path, files: &mut BTreeMap<String, FileDigest>) -> Result<()> {
    files.insert(role.into(), FileDigest { path: path.display().to_string(), sha256: manifest::sha256(path)? });
    Ok(())
}

struct Observe<'a> {
    folder: &'a Folder,
    progress: Progress,
    plan: &'a Plan,
    questions: &'a [Question],
    /// When the last unit finished (or the sweep began): units of a batch overlap, so a unit is credited with the
    /// time since the one before it finished, and the units' seconds add up to the sweep's.
    last_finished: Instant,
}

impl Observe<'_> {
    fn label(&self, key: &UnitKey) -> String {
        let t = self.plan.temperatures[key.temperature];
        let q = &self.questions[key.prompt].id;
        match key.repeat {
            Some(r) => format!("T={t} question {q} repeat {r}"),
            None => format!("T={t} question {q}"),
        }
    }
}

impl Observer for Observe<'_> {
    fn unit_started(&mut self, key: &UnitKey) {
        self.progress.unit_started(&self.label(key));
    }

    fn turn(&mut self, run: &Run) {
        let copy = crate::sampling::is_greedy(run.temperature) && (run.repeat > 0 || run.ratio != self.plan.ratios[0]);
        self.progress.turn(run, !copy);
    }

    fn unit_finished(&mut self, key: UnitKey, runs: Vec<Run>) -> Result<()> {
        let secs = self.last_finished.elapsed().as_secs_f64();
        self.last_finished = Instant::now();
        self.folder.save_unit(key, secs, runs)?;
        self.progress.unit_finished(&self.label(&key), secs);
        Ok(())
    }
}

pub fn execute(settings: &Settings, out: &Path, options: &Options) -> Result<Outcome> {
    sweep(settings, out, options, &[])
}

/// A shard's folder, as `merge` found it.
struct Part {
    dir: PathBuf,
    shard: Shard,
    files: BTreeMap<String, FileDigest>,
}

/// `frspec merge`: the shards of one sweep (`sweep --shard I/N`, every I once) joined into `out`, which then holds
/// what one machine running the whole sweep would have written. Everything is checked before `out` is made: the
/// same settings and input files, every shard present once, and every shard holding each of its units.
pub fn merge(shard_dirs: &[PathBuf], out: &Path, options: &Options) -> Result<(Settings, Outcome)> {
    let mut parts = Vec::new();
    let mut base: Option<(serde_json::Value, &Path)> = None;
    for dir in shard_dirs {
        let identity = folder::identity(dir)?;
        let mut settings = identity.settings.clone();
        let shard = match settings.as_object_mut().and_then(|s| s.remove("shard")) {
            Some(serde_json::Value::String(s)) => Shard::parse(&s)?,
            _ => bail!("{} holds a whole sweep, not a shard of one (made without --shard)", dir.display()),
        };
        match &base {
            None => base = Some((settings, dir)),
            Some((first, first_dir)) if *first != settings => {
                let (a, b) = (Identity { settings: first.clone(), files: BTreeMap::new() }, Identity { settings, files: BTreeMap::new() });
                bail!("{} was made with other settings than {} ({})", dir.display(), first_dir.display(), b.differences(&a).join("; "));
            }
            Some(_) => {}
        }
        parts.push(Part { dir: dir.clone(), shard, files: identity.files });
    }
    let (settings, _) = base.ok_or_else(|| anyhow::anyhow!("merge needs the shards' folders"))?;
    let count = parts[0].shard.count;
    if let Some(p) = parts.iter().find(|p| p.shard.count != count) {
        bail!("{} is shard {} but {} is shard {}: they split the sweep differently", p.dir.display(), p.shard, parts[0].dir.display(), parts[0].shard);
    }
    for index in 0..count {
        let holders: Vec<&Part> = parts.iter().filter(|p| p.shard.index == index).collect();
        match holders[..] {
            [] => bail!("shard {index}/{count} is missing: name every shard's folder"),
            [_] => {}
            [a, b, ..] => bail!("{} and {} are both shard {index}/{count}", a.dir.display(), b.dir.display()),
        }
    }
    let settings = Settings::from_identity(&settings)?;
    let outcome = sweep(&settings, out, options, &parts)?;
    Ok((settings, outcome))
}

/// A sweep into `out`; with `parts`, the units come from those shards' folders instead of being run.
fn sweep(settings: &Settings, out: &Path, options: &Options, parts: &[Part]) -> Result<Outcome> {
    let wall = Instant::now();
    let questions = questions(settings)?;
    check(settings, &questions)?;

    crate::engine::cpu::tensor::Activations::set(settings.activations)?;
    let target = Target::load(&settings.model)?;
    let context = target.model.config.context_length;
    if settings.max_new_tokens >= context {
        bail!("max_new_tokens is {}: the model's context holds {context} positions, prompt included", settings.max_new_tokens);
    }
    let vocab = target.model.config.vocab;
    let (rules, ratios) = cells(settings, vocab);
    let plan = plan(settings, ratios);
    let freq_path = settings.freq.as_deref().map(crate::vocab::freq_path).transpose()?;
    let freqs = freq_path.as_deref().map(Frequencies::load).transpose()?;
    let mut keeps = Vec::new();
    for rule in &rules {
        keeps.push(match (rule, &freqs) {
            (KeepRule::Ratio(r), _) if *r == 0.0 => None,
            (_, None) => bail!("pruning needs token frequencies: set freq (--freq)"),
            (rule, Some(f)) => Some(f.keep_set(*rule, vocab, &target.tokenizer.stop_ids)?),
        });
    }
    let sweep = Sweep { settings, out, options, wall, questions: &questions, plan: &plan, freq_path: freq_path.as_deref(), target: &target, parts };
    let loaded = cpu::draft::load(&settings.draft_kind, settings.draft.as_deref(), &target, &settings.model)?;
    // One draft per slot of the batch, all on one copy of the weights; the heads, one per cell, come from the first.
    // A merge decodes nothing, so it needs no GPU even for a sweep that ran on one.
    match (settings.engine, parts.is_empty()) {
        (EngineKind::Cpu, _) | (EngineKind::Candle, false) => {
            let drafts = (0..settings.batch).map(|_| loaded.fresh().boxed()).collect();
            sweep.run(&target.model, drafts, keeps)
        }
        (EngineKind::Candle, true) => {
            let (device, dtype) = (candle::device(&settings.device)?, candle::dtype(&settings.dtype)?);
            let llama = candle::llama::Llama::from_engine(&target.model, &device, dtype)?;
            let weights = DraftWeights::from_engine(&loaded, &llama)?;
            let drafts = (0..settings.batch).map(|_| weights.instance(&llama)).collect();
            sweep.run(&llama, drafts, keeps)
        }
    }
}

/// A checked sweep with its inputs loaded, ready to run on an engine.
struct Sweep<'a> {
    settings: &'a Settings,
    out: &'a Path,
    options: &'a Options,
    wall: Instant,
    questions: &'a [Question],
    plan: &'a Plan,
    freq_path: Option<&'a Path>,
    target: &'a Target,
    /// Shards whose journals a merge joins (empty for a sweep that runs its units).
    parts: &'a [Part],
}

impl Sweep<'_> {
    /// Before a merge writes anything: the shards read the same input files as this machine, and each holds every
    /// one of its units, finished and readable. The units of each part, in its order.
    fn check_parts(&self, all_units: &[UnitKey], identity: &Identity) -> Result<Vec<Vec<UnitKey>>> {
        let mut units_of_parts = Vec::new();
        for part in self.parts {
            if let Some((role, digest)) = identity.files.iter().find(|(role, d)| part.files.get(*role).map(|p| &p.sha256) != Some(&d.sha256)) {
                bail!("{}: its {role} file is not {} as found here (other contents, or missing)", part.dir.display(), digest.path);
            }
            if let Some(role) = part.files.keys().find(|role| !identity.files.contains_key(*role)) {
                bail!("{}: it read a {role} file this sweep does not", part.dir.display());
            }
            let expected = shard::units_of(self.plan, all_units, part.shard);
            let journal = folder::journal(&part.dir, &expected)?;
            let missing: Vec<String> = expected.iter().filter(|u| !journal.done.contains_key(u)).map(UnitKey::file_name).collect();
            if !missing.is_empty() {
                let why = journal.notes.iter().find(|n| n.starts_with("redoing")).map_or(String::new(), |n| format!("; {n}"));
                bail!(
                    "{} (shard {}) lacks {} of its {} units ({}{}){why}: finish it with sweep --resume --shard {}, then merge",
                    part.dir.display(),
                    part.shard,
                    missing.len(),
                    expected.len(),
                    missing.iter().take(5).cloned().collect::<Vec<_>>().join(", "),
                    if missing.len() > 5 { ", …" } else { "" },
                    part.shard
                );
            }
            units_of_parts.push(expected);
        }
        Ok(units_of_parts)
    }

    /// Run the units the folder lacks on `engine` with one draft per cell, then write the tables and the manifest.
    fn run<'t, T: crate::speculative::TargetModel>(&self, engine: &'t T, mut drafts: Vec<Box<dyn Draft<T> + 't>>, keeps: Vec<Option<KeepSet>>) -> Result<Outcome> {
        let (settings, out, options, plan, questions) = (self.settings, self.out, self.options, self.plan, self.questions);
        let vocab = self.target.model.config.vocab;
        let kept: Vec<u64> = keeps.iter().map(|k| k.as_ref().map_or(vocab, |k| k.ids.len()) as u64).collect();
        let heads = keeps.into_iter().map(|keep| DraftHead::new(drafts[0].lm_head(), keep, HeadMode::Slice)).collect::<Result<Vec<_>>>()?;

        let mut files = BTreeMap::new();
        digest("model", &self.target.source, &mut files)?;
        if let (Some(spec), false) = (&settings.draft, matches!(settings.draft_kind, DraftKind::Truncated(_))) {
            digest("draft", &crate::loading::target::resolve(spec)?, &mut files)?;
        }
        if let Some(p) = self.freq_path {
            digest("freq", p, &mut files)?;
        }
        digest("dataset", &dataset::resolve(&settings.dataset)?, &mut files)?;
        let settings_json = settings.identity_json()?;
        let identity = Identity { settings: settings_json.clone(), files };

        let all_units = plan.units(questions.len());
        let units = match settings.shard {
            Some(s) => shard::units_of(plan, &all_units, s),
            None => all_units.clone(),
        };
        let units_of_parts = self.check_parts(&all_units, &identity)?;
        let (folder, journal) = Folder::open(out, &identity, options.mode, &units)?;
        for note in &journal.notes {
            eprintln!("note: {note}");
        }
        let mut done = journal.done;
        for (part, part_units) in self.parts.iter().zip(&units_of_parts) {
            done.extend(folder.adopt(&part.dir, part_units)?);
        }
        let pending: Vec<UnitKey> = units.iter().filter(|k| !done.contains_key(k)).copied().collect();
        let turns = pending.iter().map(|k| plan.runs_per_unit(k)).sum();
        let progress = Progress::new(options.quiet, units.len(), done.len(), turns);
        let mut observe = Observe { folder: &folder, progress, plan, questions, last_finished: Instant::now() };
        let tokenizer: &Tokenizer = &self.target.tokenizer;
        let mut engine = Engine { target: engine, tokenizer, drafts: &mut drafts, heads: &heads };
        crate::sweep::run(&mut engine, questions, plan, &pending, &mut observe)?;
        observe.progress.finish();
        let merged_from = self.parts.iter().map(|p| p.dir.display().to_string()).collect();
        let manifest = |wall_secs: f64| Manifest {
            frspec: Manifest::frspec_version(),
            git_commit: Manifest::git_commit(),
            crates: manifest::crate_versions(),
            command: options.command.clone(),
            settings: &settings_json,
            files: &identity.files,
            hardware: Hardware::here(&settings.device, settings.engine, &settings.dtype),
            batch: settings.batch,
            wall_secs,
            total_wall_secs: wall_secs + done.values().sum::<f64>(),
            units_resumed: done.len(),
            units_total: units.len(),
            finished_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            merged_from,
        };
        if settings.shard.is_some() {
            // A shard's tables would summarize part of the prompts; its journal waits for `frspec merge`.
            let manifest = manifest(self.wall.elapsed().as_secs_f64());
            crate::files::write_atomic(&out.join(Manifest::FILE), serde_json::to_string_pretty(&manifest)?.as_bytes())?;
            return Ok(Outcome { summary: Vec::new(), timings: Vec::new(), units_run: pending.len(), units_resumed: done.len() });
        }

        let mut runs = folder.runs(&all_units)?;
        let index = |xs: &[f64], x: f64| xs.iter().position(|&y| y == x).expect("a plan value");
        let temps: Vec<f64> = plan.temperatures.iter().map(|&t| t as f64).collect();
        runs.sort_by_key(|r| (index(&plan.ratios, r.ratio), index(&temps, r.temperature as f64), r.repeat, r.prompt_index, r.turn));
        let categories: Vec<Option<String>> = questions.iter().map(|q| q.category.clone()).collect();
        store::write_runs(&out.join(store::RUNS), &runs, &plan.ratios, &kept, &categories, plan.k)?;
        store::write_timings(&out.join(store::TIMINGS), &runs)?;
        let summary = summary::summarize(plan, &kept, &runs)?;
        store::write_summary(&out.join(store::SUMMARY), &summary)?;
        let head_ms: Vec<f64> = heads.iter().map(|h| Ok(1e3 * crate::bench::head_secs(h, HEAD_REPS)?)).collect::<Result<_>>()?;
        let timings = summary::timings(plan, &kept, &head_ms, &runs);
        store::write_timing_summary(&out.join(store::TIMING_SUMMARY), &timings)?;

        let manifest = manifest(self.wall.elapsed().as_secs_f64());
        crate::files::write_atomic(&out.join(Manifest::FILE), serde_json::to_string_pretty(&manifest)?.as_bytes())?;
        Ok(Outcome { summary, timings, units_run: pending.len(), units_resumed: done.len() })
    }
}

