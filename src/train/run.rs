//! `frspec train-eagle`: a training folder from nothing to an exported head, resumable. The folder holds run.json
//! (what the run is), teacher.safetensors (the cached teacher data), checkpoint.safetensors, training_log.jsonl and,
//! at the end, the head itself (config.json + model.safetensors), which the engine's EAGLE-1 or EAGLE-3 loader reads.

use super::{
    chat_answers, checkpoint_due, continuations, draft_vocabulary, export, forced, load_teacher, prompts, save_teacher, self_prompts, sharegpt_follow_ups, sharegpt_prompts, teacher_data, teacher_forced,
    Arch, Conversation, Head, KeepSet, State, StepLog, TrainSettings, Trainer, WrittenRequests, SHAREGPT_MAX_PROMPT_TOKENS,
};
use crate::loading::target::Target;
use crate::text::chat::Message;
use crate::vocab::{CorpusFormat, Frequencies, KeepRule};
use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub struct TrainOptions {
    pub target: String,
    pub out: PathBuf,
    pub corpus: Vec<PathBuf>,
    pub format: CorpusFormat,
    /// Conversations the target generates for training.
    pub prompts: usize,
    /// Instruction templates for those prompts (a JSON file); the built-in set when absent.
    pub templates: Option<PathBuf>,
    /// Teacher-forced conversations whose answers are corpus text (0: none).
    pub continuations: usize,
    /// Conversations whose request the target writes itself (Magpie) before answering it (0: none).
    pub self_prompts: usize,
    /// Conversations opened by the requests of ShareGPT's users, answered by the target (0: none).
    pub sharegpt: usize,
    /// Conversations continued by ShareGPT users' later requests, with the turns before them, answered by the target
    /// (0: none).
    pub sharegpt_follow_ups: usize,
    /// The ShareGPT file; the named asset `sharegpt` when absent.
    pub sharegpt_file: Option<PathBuf>,
    pub max_new_tokens: usize,
    pub settings: TrainSettings,
    /// Another training folder whose teacher data this run may reuse.
    pub teacher_from: Option<PathBuf>,
    /// A head folder whose weights the run starts from (with fresh moments and its own schedule) instead of the
    /// initial ones; an EAGLE-3 head keeps its draft vocabulary.
    pub init_from: Option<PathBuf>,
    /// Train against a pruned vocabulary: frequencies (a file or a known name, found once the options are checked)
    /// and how many ids to keep.
    pub freq: Option<String>,
    pub keep: Option<KeepRule>,
    pub quiet: bool,
}

/// Whether a head given to --init-from can be trained for this target and run: the same kind, each tensor the shape
/// the run's own initial head has. Its draft vocabulary (EAGLE-3) replaces the one the teacher data would give.
fn fits(head: &Head, target: &Target, keep: Option<&KeepSet>, s: &TrainSettings) -> Result<Option<KeepSet>> {
    let name = head.path.display();
    if head.state.arch != s.arch {
        // As --arch spells them.
        let [theirs, ours] = [head.state.arch, s.arch].map(|a| clap::ValueEnum::to_possible_value(&a).map_or_else(String::new, |v| v.get_name().to_string()));
        bail!("--init-from {name}: an {theirs} head, but this run trains --arch {ours}");
    }
    let vocab = target.model.config.vocab;
    let keep = match &head.d2t {
        Some(d2t) => {
            let ids = crate::engine::cpu::draft::d2t_target_ids(d2t, vocab, &head.path)?;
            // A keep set is sorted (`export` writes d2t so, as vLLM's heads have it); sorted also means no id twice.
            if !ids.windows(2).all(|w| w[0] < w[1]) {
                bail!("{name}: d2t does not map the draft ids to increasing target ids");
            }
            Some(KeepSet { ids, vocab })
        }
        None => keep.cloned(),
    };
    let fresh = Trainer { target, data: &[], keep: keep.as_ref(), settings: s.clone() }.start()?;
    for ((key, ours), theirs) in s.arch.keys().iter().zip(&fresh.vars).zip(&head.state.vars) {
        if ours.dims() != theirs.dims() {
            bail!("{name}: tensor {key} is {:?}, where this target's head has {:?}", theirs.dims(), ours.dims());
        }
    }
    Ok(match s.arch {
        Arch::Eagle1 => None,
        Arch::Eagle3 => keep,
    })
}

fn bar(quiet: bool, len: usize, template: &str) -> Result<indicatif::ProgressBar> {
    let bar = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(len as u64) };
    bar.set_style(indicatif::ProgressStyle::with_template(template)?);
    Ok(bar)
}

/// Without a terminal (or with --quiet) progress comes as plain lines, now and then.
fn plain(quiet: bool) -> bool {
    use std::io::IsTerminal;
    quiet || !std::io::stderr().is_terminal()
}

/// Makes the given range of a part's conversations (the ones before are cached), reporting each as it is done.
type Producer<'a> = dyn FnMut(std::ops::Range<usize>, &mut dyn FnMut(&Conversation)) -> Result<Vec<Conversation>> + 'a;

/// Conversations are made this many at a time (sixteen batches of answers)...
const MAKE_CHUNK: usize = 256;
/// ...and the part is saved when this long has passed since it last was, so that a run stopped while making a part of
/// an hour or more (6,633 ShareGPT follow-ups) loses at most this much of it, and what is made moves from memory to
/// the mapped file. Rewriting the part each time costs seconds.
const SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

// The cached teacher data, one file per part (the requests kept as JSON, for people to read too).
const TEACHER_FILE: &str = "teacher.safetensors";
const CONTINUATIONS_FILE: &str = "continuations.safetensors";
const REQUESTS_FILE: &str = "self-prompts.json";
/// How far writing them has got, while it is under way.
const REQUESTS_PROGRESS_FILE: &str = "self-prompts-progress.json";
const SELF_PROMPTED_FILE: &str = "self-prompts.safetensors";
const SHAREGPT_FILE: &str = "sharegpt.safetensors";
const SHAREGPT_FOLLOW_UPS_FILE: &str = "sharegpt-follow-ups.safetensors";
/// Where a part's identity names the target layers it captured; absent when none (EAGLE-1).
const LAYERS_KEY: &str = "layers";

/// The ShareGPT requests this run answers, and the file they come from.
struct ShareGptRequests {
    openings: Vec<String>,
    /// Later requests, each with the turns before it.
    follow_ups: Vec<Vec<Message>>,
    file: PathBuf,
}

fn sharegpt_requests(o: &TrainOptions, target: &Target) -> Result<ShareGptRequests> {
    let path = match &o.sharegpt_file {
        Some(p) => p.clone(),
        None => crate::loading::assets::require("sharegpt")?,
    };
    let file = crate::text::sharegpt::read(&path)?;
    let in_file = |e: anyhow::Error| anyhow!("{}: {e}", path.display());
    let openings = sharegpt_prompts(&file.conversations, o.sharegpt, &target.tokenizer, SHAREGPT_MAX_PROMPT_TOKENS).map_err(in_file)?;
    let follow_ups = sharegpt_follow_ups(&file.conversations, o.sharegpt_follow_ups, &target.tokenizer, SHAREGPT_MAX_PROMPT_TOKENS).map_err(in_file)?;
    if !o.quiet {
        let opened = file.conversations.iter().filter(|c| c.first_human_turn().is_some()).count();
        let cut = file.cut_bytes.map(|n| format!(" before a record cut off after {n} bytes (ignored)")).unwrap_or_default();
        eprintln!(
            "{}: {} complete conversations{cut}, {opened} opened by a person; answering the first {} distinct opening requests and {} later ones, each chat of at most {SHAREGPT_MAX_PROMPT_TOKENS} tokens",
            path.display(),
            file.conversations.len(),
            openings.len(),
            follow_ups.len()
        );
    }
    Ok(ShareGptRequests { openings, follow_ups, file: path })
}

/// A JSON file this run or another wrote (requests, the progress writing them); unreadable, it is damaged.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow!("{} is damaged: {e}", path.display()))
}

fn write_requests(path: &Path, requests: &[String]) -> Result<()> {
    crate::files::write_atomic(path, serde_json::to_string_pretty(requests)?.as_bytes())
}

/// The requests the target wrote itself, from their file or written now and saved. Writing resumes from the progress
/// file this run saves after each batch, so a stop loses at most one batch. A file of fewer (a smaller run's, taken
/// over) grows: its requests must come out first (checked as each batch is written, so a file that differs stops the
/// run at its first difference, not after the hour all take). That file does not say which attempt ended it, so those
/// are written again; writing costs about half of answering (0.26 s against 0.45 s a request on 2 cores), and the
/// answers, the larger part, are kept.
fn cached_self_prompts(path: &Path, target: &Target, o: &TrainOptions) -> Result<Vec<String>> {
    let progress_path = path.with_file_name(REQUESTS_PROGRESS_FILE);
    let before: Vec<String> = if path.exists() { read_json(path)? } else { Vec::new() };
    if before.len() == o.self_prompts {
        return Ok(before);
    }
    if before.len() > o.self_prompts {
        bail!("{} holds {} requests, more than {}: it is damaged", path.display(), before.len(), o.self_prompts);
    }
    let progress: WrittenRequests = if progress_path.exists() { read_json(&progress_path)? } else { WrittenRequests::default() };
    progress.check(o.self_prompts).map_err(|e| anyhow!("{}: {e}: it is damaged", progress_path.display()))?;
    if plain(o.quiet) {
        if progress.attempts > 0 {
            eprintln!("self-prompts: {} of {} written before this run stopped, resuming after attempt {}", progress.requests.len(), o.self_prompts, progress.attempts);
        } else if !before.is_empty() {
            eprintln!("self-prompts: {} of {} cached, writing them again with the other {}", before.len(), o.self_prompts, o.self_prompts - before.len());
        }
    }
    let b = bar(o.quiet, o.self_prompts, "self-prompts {bar:30} {pos}/{len} requests, ETA {eta}")?;
    b.set_position(progress.requests.len() as u64);
    let (started, mut checked) = (Instant::now(), 0);
    let requests = self_prompts(target, o.self_prompts, o.settings.seed, o.max_new_tokens, progress, &mut |so_far| {
        let new = checked..so_far.requests.len();
        if let Some(i) = new.clone().find(|&i| before.get(i).is_some_and(|cached| *cached != so_far.requests[i])) {
            bail!("{}: its request {} is not the one the target writes now: it is damaged or was written another way", path.display(), i + 1);
        }
        if plain(o.quiet) && new.clone().any(|i| (i + 1) % 50 == 0) {
            eprintln!("self-prompts: {}/{} requests, {:.0} s", new.end, o.self_prompts, started.elapsed().as_secs_f64());
        }
        b.set_position(new.end as u64);
        checked = new.end;
        if so_far.requests.len() < o.self_prompts {
            crate::files::write_atomic(&progress_path, serde_json::to_string(so_far)?.as_bytes())?;
        }
        Ok(())
    })?;
    b.finish();
    write_requests(path, &requests)?;
    match std::fs::remove_file(&progress_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("cannot remove {}", progress_path.display())),
        _ => Ok(requests),
    }
}

/// Conversations from their cache file, made by `make` (with progress) where the file holds fewer than `count` — a
/// smaller run's part taken over, or one this run saved before it stopped, which every part's prefix-stability makes
/// the first of these — and cached (read back in place from the file). A cached
/// part made without the `capture` layers (an EAGLE-1 run's, taken over) gets them from one forward of each
/// conversation through the target, which gives what generating would have recorded, and is saved with them.
fn cached(path: &Path, count: usize, label: &str, quiet: bool, target: &Target, capture: &[usize], make: &mut Producer) -> Result<Vec<Conversation>> {
    let hidden = target.model.config.hidden;
    let mut data = if path.exists() { load_teacher(path, hidden)? } else { Vec::new() };
    if data.len() > count {
        bail!("{} holds {} conversations, more than the {count} of its run: it is damaged", path.display(), data.len());
    }
    let mut changed = false;
    if !capture.is_empty() && data.iter().any(|c| c.layers.is_empty()) {
        let b = bar(quiet, data.len(), &format!("{label}: the target's layers {{bar:30}} {{pos}}/{{len}} conversations, ETA {{eta}}"))?;
        let started = Instant::now();
        let mut filled = Vec::with_capacity(count);
        for c in data {
            filled.push(forced(&target.model, c.tokens, c.prompt_len, capture)?);
            b.inc(1);
            if plain(quiet) && filled.len() % 200 == 0 {
                eprintln!("{label}: the target's layers for {}/{count} conversations, {:.0} s", filled.len(), started.elapsed().as_secs_f64());
            }
        }
        b.finish();
        (data, changed) = (filled, true);
    }
    if data.len() < count {
        let from = data.len();
        if from > 0 && plain(quiet) {
            eprintln!("{label}: the first {from} of {count} conversations cached, making the other {}", count - from);
        }
        let b = bar(quiet, count - from, &format!("{label} {{bar:30}} {{pos}}/{{len}} conversations, {{msg}} tokens, ETA {{eta}}"))?;
        let mut tokens = 0;
        let (started, mut done, mut saved) = (Instant::now(), 0, Instant::now());
        let mut on_done = |c: &Conversation| {
            tokens += c.tokens.len();
            done += 1;
            b.set_message(tokens.to_string());
            b.inc(1);
            if plain(quiet) && done % 50 == 0 {
                eprintln!("{label}: {}/{count} conversations, {tokens} tokens, {:.0} s", from + done, started.elapsed().as_secs_f64());
            }
        };
        while data.len() < count {
            let chunk = data.len()..count.min(data.len() + MAKE_CHUNK);
            data.extend(make(chunk, &mut on_done)?);
            if data.len() < count && saved.elapsed() >= SAVE_EVERY {
                save_teacher(path, &data, hidden)?;
                data = load_teacher(path, hidden)?;
                saved = Instant::now();
            }
        }
        b.finish();
        changed = true;
    }
    if changed {
        save_teacher(path, &data, hidden)?;
        data = load_teacher(path, hidden)?;
    }
    Ok(data)
}

/// Whether this run can take over a part of another run's teacher data, and then whether only its first `n`
/// conversations: the part made the same way, in as many or more — or in fewer, which `cached` (and
/// `cached_self_prompts`) then complete. Every part is prefix-stable (prompts and passages are drawn in a seeded
/// order, each conversation is answered or read as it would be alone, requests the target writes come from one
/// stream per attempt), so the first `n` of more are the `n` made alone, and fewer made alone are the first of more.
/// A part made without the target layers this run needs is taken too: `cached` adds them.
fn taken(ours: &serde_json::Value, theirs: &serde_json::Value, count_key: &str) -> Option<Option<usize>> {
    let count = |v: &serde_json::Value| v.get(count_key).and_then(|c| c.as_u64());
    let (n, available) = (count(ours)?, count(theirs)?);
    if n == 0 {
        return None;
    }
    let mut same_count = theirs.clone();
    same_count[count_key] = ours[count_key].clone();
    if let (Some(layers), None) = (ours.get(LAYERS_KEY), theirs.get(LAYERS_KEY)) {
        same_count[LAYERS_KEY] = layers.clone();
    }
    (same_count == *ours && available > 0).then_some((available > n).then_some(n as usize))
}

/// Take a teacher-data file of another run, or only its first `take` conversations (requests). A whole file is
/// linked where the file system allows, else copied: teacher data is only ever written whole to a new file and
/// renamed into place, never changed in place, so two runs can share it (EAGLE-3's later stages share 16 GB).
fn take_over(from: &Path, to: &Path, take: Option<usize>, hidden: usize) -> Result<()> {
    let Some(n) = take else {
        if std::fs::hard_link(from, to).is_err() {
            std::fs::copy(from, to).with_context(|| format!("cannot copy {}", from.display()))?;
        }
        return Ok(());
    };
    let short = || anyhow!("{} holds fewer than the {n} its run.json promises: it is damaged", from.display());
    if from.ends_with(REQUESTS_FILE) {
        write_requests(to, read_json::<Vec<String>>(from)?.get(..n).ok_or_else(short)?)
    } else {
        save_teacher(to, load_teacher(from, hidden)?.get(..n).ok_or_else(short)?, hidden)
    }
}

/// What a finished training run logged, for its curve.
pub struct Trained {
    /// Every step of the run, resumed ones included.
    pub log: Vec<StepLog>,
    pub title: String,
    pub settings: TrainSettings,
}

/// A training step allocates several f32 tensors of [positions, vocabulary] (≈ 100 MB at SmolLM2's 49,152 ids, well
/// above glibc's 32 MiB ceiling for serving from the heap), each of which glibc maps afresh and unmaps when freed,
/// so every step faulted in and zeroed new pages: a fifth of a whole-vocabulary step's samples. Served from the heap
/// and kept there when freed, the next step's tensors reuse the same pages (the same bits;
/// results/train/training-speed-2026-12-03.md, its last section). Set here, not for every command: sweeps allocate
/// nothing that size. No crate exposes glibc's allocator settings but libc's binding.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; memory already handed out is unaffected.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Train (or resume) a head; `None` for `--steps 0`, which writes the untrained head and logs no steps.
pub fn train_eagle(o: &TrainOptions) -> Result<Option<Trained>> {
    let s = &o.settings;
    if s.batch == 0 || o.max_new_tokens == 0 || s.checkpoint_every == 0 {
        bail!("--batch, --max-new-tokens and --checkpoint-every must be at least 1");
    }
    if s.batch > o.prompts + o.continuations + o.self_prompts + o.sharegpt + o.sharegpt_follow_ups {
        bail!(
            "--batch {} is larger than --prompts {}, --continuations {}, --self-prompts {}, --sharegpt {} and --sharegpt-follow-ups {} together",
            s.batch,
            o.prompts,
            o.continuations,
            o.self_prompts,
            o.sharegpt,
            o.sharegpt_follow_ups
        );
    }
    let numbers = [("--lr", s.lr), ("--weight-decay", s.weight_decay), ("--classification-weight", s.classification_weight), ("--feature-weight", s.feature_weight), ("--unroll-decay", s.unroll_decay)];
    for (flag, w) in numbers {
        if !(w.is_finite() && w >= 0.0) {
            bail!("{flag} must be a finite number ≥ 0, not {w}");
        }
    }
    if s.arch == Arch::Eagle3 {
        if o.freq.is_some() || o.keep.is_some() {
            bail!("--arch eagle3 drafts over its own draft vocabulary (--draft-vocab), not a keep set: drop --freq and --ratio/--keep");
        }
        if s.feature_weight != 0.0 {
            bail!("--arch eagle3 has no feature regression (its outputs are not the target's features): --feature-weight must be 0");
        }
        if s.steps == 0 && o.init_from.is_none() {
            bail!("--arch eagle3 --steps 0: the draft vocabulary comes from the teacher data, so an untrained head needs at least one step (or --init-from a head, whose vocabulary it keeps)");
        }
    }
    keep_freed_memory();
    let freq = o.freq.as_deref().map(crate::vocab::freq_path).transpose()?;
    let files = crate::vocab::corpus_files(&o.corpus)?;
    let mut lines = Vec::new();
    for f in &files {
        lines.extend(crate::vocab::corpus_lines(f, o.format)?);
    }
    if lines.is_empty() {
        bail!("the corpus ({}) holds no text", o.corpus.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    let templates = match &o.templates {
        Some(path) => super::load_templates(path)?,
        None => super::TEMPLATES.map(String::from).to_vec(),
    };
    let prompts = prompts(&lines, o.prompts, s.seed, &templates)?;
    // Made before anything is written, so a corpus that cannot give them leaves no folder behind.
    let continuations = if o.continuations > 0 { continuations(&lines, o.continuations, s.seed)? } else { Vec::new() };
    let target = Target::load(&o.target)?;
    let keep = match (&o.keep, &freq) {
        (None, None) => None,
        (Some(rule), Some(f)) => Some(Frequencies::load(f)?.keep_set(*rule, target.model.config.vocab, &target.tokenizer.stop_ids)?),
        _ => bail!("training against a pruned vocabulary needs both --freq and --ratio/--keep"),
    };
    let sharegpt = if o.sharegpt + o.sharegpt_follow_ups > 0 { Some(sharegpt_requests(o, &target)?) } else { None };
    let vocab = target.model.config.vocab;
    let init = o.init_from.as_deref().map(Head::load).transpose()?;
    let draft_vocab = match init.as_ref().and_then(|h| h.d2t.as_ref()) {
        Some(d2t) if s.draft_vocab != 0 && s.draft_vocab != d2t.len() => {
            bail!("--draft-vocab {} differs from the {} draft ids of the --init-from head", s.draft_vocab, d2t.len())
        }
        Some(d2t) => d2t.len(),
        None if s.arch == Arch::Eagle3 && s.draft_vocab == 0 => vocab / 4,
        None => s.draft_vocab,
    };
    let s = &TrainSettings { draft_vocab, ..s.clone() };
    if s.draft_vocab > vocab {
        bail!("--draft-vocab {} is larger than the target's vocabulary of {vocab}", s.draft_vocab);
    }
    let capture = s.arch.capture(&target.model.config);
    if s.arch == Arch::Eagle3 && target.model.config.layers < 4 {
        bail!("--arch eagle3 reads three residual streams of the target, which has {} layers (at least 4 needed)", target.model.config.layers);
    }
    let init_vocabulary = init.as_ref().map(|head| fits(head, &target, keep.as_ref(), s)).transpose()?.flatten();

    // What the teacher data depends on; the rest of the identity is how the head is trained.
    let mut data_identity = serde_json::json!({
        "target": o.target,
        "target_sha256": crate::outputs::manifest::sha256(&target.source)?,
        // By content: a corpus edited in place makes other teacher data.
        "corpus_sha256": files.iter().map(|f| crate::outputs::manifest::sha256(f)).collect::<Result<Vec<_>>>()?,
        "prompts": o.prompts,
        "max_new_tokens": o.max_new_tokens,
        "seed": s.seed,
    });
    // The templates themselves, not their file's path; absent for the built-in set, so older folders resume.
    if o.templates.is_some() {
        data_identity["templates"] = serde_json::json!(templates);
    }
    let continuation_identity = serde_json::json!({
        "target_sha256": data_identity["target_sha256"],
        "corpus_sha256": data_identity["corpus_sha256"],
        "count": o.continuations,
        "max_answer_tokens": o.max_new_tokens,
        "seed": s.seed,
    });
    let self_prompt_identity = serde_json::json!({
        "target_sha256": data_identity["target_sha256"],
        "count": o.self_prompts,
        "max_new_tokens": o.max_new_tokens,
        "seed": s.seed,
    });
    let mut identity = serde_json::json!({
        "data": data_identity,
        "settings": s,
        "keep": o.keep.map(|k| format!("{k:?}")),
        "freq_sha256": freq.as_deref().map(crate::outputs::manifest::sha256).transpose()?,
    });
    // Absent when unused, so folders made before --init-from keep their identity.
    if let Some(head) = &init {
        identity["init_sha256"] = serde_json::json!(crate::outputs::manifest::sha256(&head.path)?);
    }
    // Absent when unused, so folders made before continuations existed keep their identity.
    if o.continuations > 0 {
        identity["continuations"] = continuation_identity;
    }
    if o.self_prompts > 0 {
        identity["self_prompts"] = self_prompt_identity;
    }
    if let Some(requests) = &sharegpt {
        let file_sha256 = crate::outputs::manifest::sha256(&requests.file)?;
        for (part, count) in [("sharegpt", o.sharegpt), ("sharegpt_follow_ups", o.sharegpt_follow_ups)] {
            if count > 0 {
                identity[part] = serde_json::json!({
                    "target_sha256": data_identity["target_sha256"],
                    "file_sha256": file_sha256,
                    "count": count,
                    "max_prompt_tokens": SHAREGPT_MAX_PROMPT_TOKENS,
                    "max_new_tokens": o.max_new_tokens,
                });
            }
        }
    }
    // The target's arithmetic makes its answers and features: data made with 8-bit activations is not the data made
    // with f32 ones. Absent for the mode every folder before this key was made in, so those folders resume.
    let activations = crate::engine::cpu::tensor::Activations::get();
    for part in ["data", "continuations", "self_prompts", "sharegpt", "sharegpt_follow_ups"] {
        if let Some(p) = identity.get_mut(part) {
            if !capture.is_empty() {
                p[LAYERS_KEY] = serde_json::json!(capture);
            }
            if !activations.is_unnamed() {
                p["activations"] = serde_json::json!(activations.name());
            }
        }
    }
    // Which parts of another run's teacher data to take over: each one made the same way, so a run with more
    // generated conversations can still take the other's continuations, and one with fewer the first of them.
    // Checked before anything is written.
    let mut reuse = Vec::new();
    if let Some(other) = &o.teacher_from {
        let theirs = std::fs::read_to_string(other.join("run.json")).with_context(|| format!("--teacher-from {}: no run.json", other.display()))?;
        let theirs: serde_json::Value = serde_json::from_str(&theirs).map_err(|e| anyhow!("{}/run.json is damaged: {e}", other.display()))?;
        let parts: [(&str, &str, &[&str]); 5] = [
            ("data", "prompts", &[TEACHER_FILE]),
            ("continuations", "count", &[CONTINUATIONS_FILE]),
            ("self_prompts", "count", &[REQUESTS_FILE, SELF_PROMPTED_FILE]),
            ("sharegpt", "count", &[SHAREGPT_FILE]),
            ("sharegpt_follow_ups", "count", &[SHAREGPT_FOLLOW_UPS_FILE]),
        ];
        for (part, count_key, files) in parts {
            if let Some(take) = identity.get(part).and_then(|ours| taken(ours, theirs.get(part)?, count_key)) {
                reuse.extend(files.iter().map(|name| (other.join(name), o.out.join(name), take)));
            }
        }
        if reuse.is_empty() {
            bail!(
                "--teacher-from {}: none of its teacher data (generated conversations, continuations, self-prompted conversations, ShareGPT openings or later requests) was made from this target, corpus, answer length and seed",
                other.display()
            );
        }
    }
    let run_json = o.out.join("run.json");
    if o.out.exists() && std::fs::read_dir(&o.out)?.next().is_some() {
        let text = std::fs::read_to_string(&run_json)
            .map_err(|_| anyhow!("{} exists and does not hold a frspec training run: choose another --out", o.out.display()))?;
        let theirs: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow!("{} is damaged: {e}", run_json.display()))?;
        if theirs != identity {
            // Either side's keys: a part one run has and the other lacks differs too.
            let keys: std::collections::BTreeSet<&String> = [&identity, &theirs].iter().flat_map(|v| v.as_object().into_iter().flatten().map(|(k, _)| k)).collect();
            let differ: Vec<&str> = keys.into_iter().filter(|k| identity.get(k) != theirs.get(k)).map(String::as_str).collect();
            bail!("{} holds another training run (differs in: {}): choose another --out", o.out.display(), differ.join(", "));
        }
    }
    std::fs::create_dir_all(&o.out).with_context(|| format!("cannot create {}", o.out.display()))?;
    crate::files::write_atomic(&run_json, serde_json::to_string_pretty(&identity)?.as_bytes())?;

    if s.steps == 0 {
        // No step: the --init-from head as it is (a packed one unpacked, in the layout train-eagle exports), else
        // initial weights.
        let keep = init_vocabulary.or(keep);
        let (state, what) = match init {
            Some(head) => (head.state, "the --init-from head"),
            None => (Trainer { target: &target, data: &[], keep: keep.as_ref(), settings: s.clone() }.start()?, "untrained (initial) head"),
        };
        export(&o.out, &state, &target.model, keep.as_ref())?;
        eprintln!("{what} written to {}", o.out.display());
        return Ok(None);
    }
    let hidden = target.model.config.hidden;
    let target_ref = &target;
    let cache_part = |path: &Path, count: usize, label: &str, make: &mut Producer| cached(path, count, label, o.quiet, target_ref, &capture, make);
    for (from, to, take) in &reuse {
        if !to.exists() && from.exists() {
            take_over(from, to, *take, hidden)?;
        }
    }
    let mut data = Vec::new();
    if !prompts.is_empty() {
        data.extend(cache_part(&o.out.join(TEACHER_FILE), prompts.len(), "teacher data", &mut |chunk, on_done| {
            teacher_data(&target, &prompts[chunk], o.max_new_tokens, &capture, on_done)
        })?);
    }
    if !continuations.is_empty() {
        data.extend(cache_part(&o.out.join(CONTINUATIONS_FILE), continuations.len(), "continuations", &mut |chunk, on_done| {
            teacher_forced(&target, &continuations[chunk], o.max_new_tokens, &capture, on_done)
        })?);
    }

    if o.self_prompts > 0 {
        let requests = cached_self_prompts(&o.out.join(REQUESTS_FILE), &target, o)?;
        data.extend(cache_part(&o.out.join(SELF_PROMPTED_FILE), requests.len(), "self-prompted answers", &mut |chunk, on_done| {
            teacher_data(&target, &requests[chunk], o.max_new_tokens, &capture, on_done)
        })?);
    }
    if let Some(requests) = &sharegpt {
        if !requests.openings.is_empty() {
            data.extend(cache_part(&o.out.join(SHAREGPT_FILE), requests.openings.len(), "ShareGPT answers", &mut |chunk, on_done| {
                teacher_data(&target, &requests.openings[chunk], o.max_new_tokens, &capture, on_done)
            })?);
        }
        if !requests.follow_ups.is_empty() {
            data.extend(cache_part(&o.out.join(SHAREGPT_FOLLOW_UPS_FILE), requests.follow_ups.len(), "ShareGPT later answers", &mut |chunk, on_done| {
                chat_answers(&target, &requests.follow_ups[chunk], o.max_new_tokens, &capture, on_done)
            })?);
        }
    }
    let keep = match (s.arch, init_vocabulary) {
        (Arch::Eagle1, _) => keep,
        (Arch::Eagle3, Some(head_vocabulary)) => Some(head_vocabulary),
        (Arch::Eagle3, None) => Some(draft_vocabulary(&data, s.draft_vocab, vocab)?),
    };

    let trainer = Trainer { target: &target, data: &data, keep: keep.as_ref(), settings: s.clone() };
    let checkpoint_path = o.out.join("checkpoint.safetensors");
    let mut state = match init {
        _ if checkpoint_path.exists() => State::load(&checkpoint_path)?,
        Some(head) => head.state,
        None => trainer.start()?,
    };
    let log_path = o.out.join("training_log.jsonl");
    // Lines past the checkpoint were written by an interrupted run; the resumed one writes them again.
    let kept_lines: Vec<String> = std::fs::read_to_string(&log_path)
        .unwrap_or_default()
        .lines()
        .filter(|l| serde_json::from_str::<StepLog>(l).is_ok_and(|x| x.step <= state.step))
        .map(String::from)
        .collect();
    let mut log = std::fs::File::create(&log_path).with_context(|| format!("cannot write {}", log_path.display()))?;
    for l in &kept_lines {
        writeln!(log, "{l}")?;
    }
    let b = bar(o.quiet, s.steps, "training {bar:30} {pos}/{len} steps, {msg}, ETA {eta}")?;
    b.set_position(state.step as u64);
    let started = Instant::now();
    let mut positions = 0usize;
    trainer.run(&mut state, s.steps, &mut |st, l| {
        writeln!(log, "{}", serde_json::to_string(l)?)?;
        positions += l.positions;
        b.set_message(format!("loss {:.4}, top-1 {:.1}%, {:.0} positions/s", l.loss, 100.0 * l.top1, positions as f64 / started.elapsed().as_secs_f64()));
        b.inc(1);
        if checkpoint_due(st.step, s) {
            st.save(&checkpoint_path)?;
            if plain(o.quiet) {
                eprintln!("step {}/{}: loss {:.4}, top-1 {:.1}%, {:.0} s", st.step, s.steps, l.loss, 100.0 * l.top1, started.elapsed().as_secs_f64());
            }
        }
        Ok(())
    })?;
    b.finish();
    drop(log);
    export(&o.out, &state, &target.model, keep.as_ref())?;
    let log: Vec<StepLog> = std::fs::read_to_string(&log_path)?.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let mut title = format!("{} head for {} · {} conversations · {} steps × {} conversations", s.arch.name(), o.target, data.len(), s.steps, s.batch);
    if o.init_from.is_some() {
        title += " · from a trained head";
    }
    eprintln!("head written to {} ({} steps, {:.0} s this run)", o.out.display(), state.step, started.elapsed().as_secs_f64());
    Ok(Some(Trained { log, title, settings: s.clone() }))
}
