use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use frspec::chat::Message;
use frspec::speculative::decode::{speculative_turn, SpecConfig};
use frspec::speculative::{DraftHead, DraftKind, DraftMode, HeadMode};
use frspec::sampling::Sampling;
use frspec::sweep::FolderMode;
use frspec::vocab::{CorpusFormat, Frequencies, KeepRule, KeepSet};
use frspec::target::{Target, DEFAULT_MODEL};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "frspec", version, args_override_self = true, about = "Measure what FR-Spec vocabulary pruning does to speculative-decoding acceptance")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// A named offline asset (smollm2), a .gguf/.safetensors file, a model folder, or a hub repo id (org/name[@rev]).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Compute device. This build computes on the CPU only.
    #[arg(long, default_value = "cpu")]
    device: String,
}

impl ModelArgs {
    fn load(&self) -> Result<Target> {
        if self.device != "cpu" {
            bail!("--device {}: this build of frspec runs models on the CPU only (use --device cpu)", self.device);
        }
        Target::load(&self.model)
    }
}

/// Speculative decoding: the draft, its pruned head and how it proposes.
#[derive(clap::Args)]
struct SpecArgs {
    /// Draft: an EAGLE-1 head folder or repo, or a draft model; absent with --draft-kind truncated:N.
    #[arg(long)]
    draft: Option<String>,
    /// eagle | eagle3 | model | truncated:N. Without it and without --draft, decoding is target-only.
    #[arg(long)]
    draft_kind: Option<DraftKind>,
    /// Token frequencies that rank the vocabulary for pruning (frspec, FR-Spec or vLLM format), or a named one
    /// such as brown-smollm2.
    #[arg(long)]
    freq: Option<String>,
    /// Fraction of the vocabulary to prune from the draft head, in [0, 1).
    #[arg(long, conflicts_with_all = ["keep", "mass"])]
    ratio: Option<f64>,
    /// Number of most frequent ids the draft head keeps.
    #[arg(long, conflicts_with = "mass")]
    keep: Option<usize>,
    /// Keep the most frequent ids until they cover this share of the counted tokens, in (0, 1].
    #[arg(long)]
    mass: Option<f64>,
    /// Draft tokens per step.
    #[arg(long, default_value_t = 4)]
    k: usize,
    #[arg(long, value_enum, default_value = "argmax")]
    draft_mode: DraftMode,
    #[arg(long, value_enum, default_value = "slice")]
    head: HeadMode,
}

impl SpecArgs {
    fn enabled(&self) -> bool {
        self.draft.is_some() || self.draft_kind.is_some()
    }

    fn keep_rule(&self) -> Option<KeepRule> {
        match (self.ratio, self.keep, self.mass) {
            (Some(r), _, _) => Some(KeepRule::Ratio(r)),
            (_, Some(k), _) => Some(KeepRule::Keep(k)),
            (_, _, Some(m)) => Some(KeepRule::Mass(m)),
            _ => None,
        }
    }

    /// The keep set for `target`, or None for the full head.
    fn keep_set(&self, target: &Target) -> Result<Option<KeepSet>> {
        let Some(rule) = self.keep_rule() else {
            if self.freq.is_some() {
                bail!("--freq needs --ratio, --keep or --mass");
            }
            return Ok(None);
        };
        rule.validate()?;
        if rule == KeepRule::Ratio(0.0) {
            return Ok(None);
        }
        let freq = self.freq.as_ref().ok_or_else(|| anyhow::anyhow!("--ratio/--keep/--mass need --freq"))?;
        let freqs = Frequencies::open(freq)?;
        Ok(Some(freqs.keep_set(rule, target.model.config.vocab, &target.tokenizer.stop_ids)?))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Chat with the target model: prints the reply, token counts and tokens/s.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        /// A system prompt; without one the chat template's default applies.
        #[arg(long)]
        system: Option<String>,
        #[arg(long, default_value_t = 256)]
        max_new_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Teacher-forced scoring along a fixed token sequence: per position log p(next token) and the top-1 id.
    Score {
        #[command(flatten)]
        model: ModelArgs,
        /// Plain text, tokenized as written (special-token strings are matched).
        #[arg(long, conflicts_with = "tokens_file", required_unless_present = "tokens_file")]
        text_file: Option<PathBuf>,
        /// A JSON array of token ids.
        #[arg(long)]
        tokens_file: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        /// Also write every position's logits as a float32 .npy of shape [n, vocab].
        #[arg(long)]
        logits_out: Option<PathBuf>,
    },
    /// The ratio × temperature × repeat matrix on a prompt set: acceptance with confidence intervals, in Parquet.
    Sweep {
        #[command(flatten)]
        spec: frspec::spec::SweepSpec,
        /// A sweep file (TOML; keys as the flags, in snake_case). Flags override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// vLLM's --speculative-config JSON (method, model, num_speculative_tokens, token_ids_by_frequency,
        /// pruning_ratio). Flags override it.
        #[arg(long)]
        speculative_config: Option<String>,
        /// Output folder.
        #[arg(long, default_value = "frspec-sweep")]
        out: PathBuf,
        /// Continue the sweep already in --out, skipping its finished units.
        #[arg(long, conflicts_with = "overwrite")]
        resume: bool,
        /// Replace a sweep already in --out.
        #[arg(long)]
        overwrite: bool,
        /// Plain progress lines instead of bars.
        #[arg(long)]
        quiet: bool,
    },
    /// Plots of a sweep folder (PNG and SVG) into DIR/plots/.
    Plot {
        /// A sweep's output folder.
        dir: PathBuf,
    },
    /// A sweep's table in Markdown (ratios as columns, length and rate rows with 95% intervals).
    Report {
        dir: PathBuf,
        /// Write to this file instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Compare a sweep with a baseline sweep: exit 0 pass, 1 regression, 2 unusable input.
    Check {
        /// The baseline sweep folder (summary.parquet + manifest.json).
        #[arg(long)]
        baseline: PathBuf,
        /// The current sweep folder.
        #[arg(long)]
        current: PathBuf,
        #[arg(long, value_enum, value_delimiter = ',', action = clap::ArgAction::Set, default_value = "mean-acceptance-length,acceptance-rate")]
        metric: Vec<frspec::check::CheckMetric>,
        /// The drop always allowed, as a share of the baseline value; the confidence intervals may allow more.
        #[arg(long, default_value_t = 0.01)]
        tolerance: f64,
        /// Make the current sweep the baseline (copies its summary and manifest) instead of checking.
        #[arg(long)]
        update_baseline: bool,
    },
    /// Train an EAGLE-1 head for a target on its own answers to prompts made from a corpus; resumable.
    TrainEagle {
        /// The frozen target: a named asset, a .gguf/.safetensors file, a model folder or a hub repo id.
        #[arg(long, default_value = DEFAULT_MODEL)]
        target: String,
        /// The training folder; the head (config.json + model.safetensors) is written into it.
        #[arg(long)]
        out: PathBuf,
        /// Corpus files or folders the prompts are made from (never the evaluation set).
        #[arg(long, required = true, num_args = 1..)]
        corpus: Vec<PathBuf>,
        #[arg(long, value_enum, default_value = "text")]
        format: CorpusFormat,
        /// Conversations the target answers for training.
        #[arg(long, default_value_t = 1000)]
        prompts: usize,
        /// Instruction templates for those prompts: a JSON list of strings, each with {} where the passage goes
        /// (datasets/train-templates.json: 24 of the kinds MT-Bench asks for); the built-in ten when absent.
        #[arg(long)]
        templates: Option<PathBuf>,
        /// Teacher-forced conversations: a corpus passage to continue, answered by the passages that follow it
        /// (the target reads them in one forward instead of generating), mixed into the training data.
        #[arg(long, default_value_t = 0)]
        continuations: usize,
        /// Conversations whose request the target writes itself before answering it (Magpie: the chat up to the
        /// user's turn, continued by sampling at temperature 1), mixed into the training data.
        #[arg(long, default_value_t = 0)]
        self_prompts: usize,
        /// Longest answer per conversation (generated, or corpus text for --continuations), in tokens.
        #[arg(long, default_value_t = 192)]
        max_new_tokens: usize,
        /// Optimisation steps; 0 writes the untrained initial head (for comparisons) without generating data.
        #[arg(long, default_value_t = 2000)]
        steps: usize,
        /// Conversations per step.
        #[arg(long, default_value_t = 4)]
        batch: usize,
        /// Peak learning rate (AdamW), reached after --warmup steps, then cosine decay to a tenth.
        #[arg(long, default_value_t = 1e-3)]
        lr: f64,
        #[arg(long, default_value_t = 100)]
        warmup: usize,
        #[arg(long, default_value_t = 0.0)]
        weight_decay: f64,
        #[arg(long, default_value_t = 100)]
        checkpoint_every: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also train the second draft of a step: a pass fed the head's own predicted features. It doubles the step
        /// cost and has not paid on SmolLM2 (results/train), so it is off unless asked for.
        #[arg(long)]
        rollout: bool,
        /// Weight of the cross-entropy against the target's next-token distribution beside the feature regression
        /// (EAGLE-1's 0.1).
        #[arg(long, default_value_t = frspec::train::EAGLE_CLASSIFICATION_WEIGHT)]
        classification_weight: f64,
        /// Reuse the teacher data of another training folder made from the same target, corpus and seed, in as many
        /// conversations or more (then its first ones).
        #[arg(long)]
        teacher_from: Option<PathBuf>,
        /// Train against a pruned vocabulary ranked by these frequencies (a file or a named one such as
        /// brown-smollm2; with --ratio or --keep).
        #[arg(long)]
        freq: Option<String>,
        #[arg(long, conflicts_with = "keep")]
        ratio: Option<f64>,
        #[arg(long)]
        keep: Option<usize>,
        /// Compute device. Training runs on the CPU only in this build.
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long)]
        quiet: bool,
    },
    /// Speed measurements.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a small Llama with seeded random weights and a byte tokenizer as a model folder, for checks that may
    /// download nothing (scripts/gpu-check.sh compares the GPU with the CPU engine on one).
    SyntheticModel {
        #[arg(long)]
        out: PathBuf,
        /// A multiple of 64 (heads of 32 dimensions, half as many KV heads).
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// At least 258 (the byte tokenizer's ids).
        #[arg(long, default_value_t = 2048)]
        vocab: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Token-frequency files that rank the vocabulary for pruning.
    #[command(subcommand)]
    Freq(FreqCommand),
}

#[derive(Subcommand)]
enum FreqCommand {
    /// Count the tokens of corpus files with a tokenizer and write a frequency file (safetensors).
    Build {
        /// Tokenizer: a model spec, a .gguf, a tokenizer.json or its folder, or a named asset (llama31-tokenizer).
        #[arg(long)]
        tokenizer: String,
        /// Corpus files or folders (every file inside, sorted by name).
        #[arg(long, required = true, num_args = 1..)]
        corpus: Vec<PathBuf>,
        #[arg(long, value_enum, default_value = "text")]
        format: CorpusFormat,
        #[arg(long)]
        out: PathBuf,
    },
    /// Count the tokens the target itself generates (greedy) on a dataset's first turns: vLLM's "target-dist".
    FromOutputs {
        #[command(flatten)]
        model: ModelArgs,
        /// A named asset (mt-bench), a JSON-lines file, or a hub dataset (org/name[@rev][:file]).
        #[arg(long, default_value = "mt-bench")]
        dataset: String,
        /// Use the first N questions (default: all).
        #[arg(long)]
        num_prompts: Option<usize>,
        #[arg(long, default_value_t = 256)]
        max_new_tokens: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the coverage of a frequency file: the share of counted tokens kept at each pruning ratio.
    Show {
        file: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75,0.9,0.95,0.99")]
        ratios: Vec<f64>,
        /// The vocabulary the ratios apply to (default: the file's own).
        #[arg(long)]
        vocab: Option<usize>,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Target-only decode and prefill tokens/s, and the cost of a block forward against a one-token forward.
    /// With --device cuda, --dtype f16/bf16, --shape or --candle it runs the candle backend instead of the CPU
    /// engine, and adds a verification pass and an EAGLE-1 drafting step at each ratio.
    Decode {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value = "What is the capital of France?")]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        new_tokens: usize,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Engine only: tokens of the block forward compared with a one-token forward.
        #[arg(long, default_value_t = 5)]
        block: usize,
        /// Engine only: sequences decoded together, one batched forward a step, for the batched decode rate.
        #[arg(long, default_value_t = 8)]
        sequences: usize,
        /// Random weights of a named shape (llama31-8b, smollm2-135m) instead of --model; speed does not depend on
        /// the values.
        #[arg(long)]
        shape: Option<String>,
        /// f32, f16 or bf16 (candle backend).
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// The candle backend on the CPU (the GPU path's code, checkable here).
        #[arg(long)]
        candle: bool,
        /// Prompt length for --shape (token ids spread over the vocabulary).
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Draft tokens per speculative step.
        #[arg(long, default_value_t = 4)]
        k: usize,
        #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.75,0.9,0.99")]
        ratios: Vec<f64>,
        /// Mean acceptance lengths at which to project speculative tokens/s.
        #[arg(long, value_delimiter = ',', default_value = "1.5,2,2.5,3")]
        lengths: Vec<f64>,
        /// Also decode on the CPU engine and compare greedy tokens (with --model).
        #[arg(long)]
        compare_engine: bool,
        #[arg(long)]
        json: bool,
    },
    /// A T = 0 sweep over ratios, run as independent speculative loops and through the greedy fast path.
    FastPath {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        draft: Option<String>,
        /// eagle | eagle3 | model | truncated:N.
        #[arg(long, default_value = "truncated:4")]
        draft_kind: DraftKind,
        /// A frequency file or a named one such as brown-smollm2.
        #[arg(long)]
        freq: String,
        #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,0.9,0.95,0.99")]
        ratios: Vec<f64>,
        #[arg(long, default_value = "mt-bench")]
        dataset: String,
        #[arg(long, default_value_t = 5)]
        num_prompts: usize,
        #[arg(long, default_value_t = 4)]
        k: usize,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
    },
    /// LM-head latency [B, H] × [H, V′] against batch and kept vocabulary, with bytes/s, FLOP/s and roofline share.
    Head {
        #[arg(long, default_value_t = 4096)]
        hidden: usize,
        #[arg(long, default_value_t = 128_256)]
        vocab: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,1024")]
        batch: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.75,0.9,0.99")]
        ratios: Vec<f64>,
        /// Weight dtype (activations are f32).
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// cpu (frspec's kernel), or cuda[:N] (candle's matmul; needs a build with --features cuda).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Folder for head.parquet and the latency plot (head_latency.png / .svg).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Draft LM-head time and draft-step time against the pruning ratio: full vs slice vs mask heads.
    Draft {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        draft: Option<String>,
        /// eagle | eagle3 | model | truncated:N.
        #[arg(long, default_value = "truncated:2")]
        draft_kind: DraftKind,
        /// A frequency file or a named one such as brown-smollm2.
        #[arg(long)]
        freq: String,
        #[arg(long, value_delimiter = ',', default_value = "0.5,0.75,0.9,0.99")]
        ratios: Vec<f64>,
        #[arg(long, default_value_t = 4)]
        k: usize,
        #[arg(long, default_value_t = 50)]
        reps: usize,
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate { model, prompt, system, max_new_tokens, temperature, top_p, seed, spec } => {
            let sampling = Sampling::new(temperature, top_p)?;
            if spec.k == 0 {
                bail!("--k must be at least 1");
            }
            if let Some(rule) = spec.keep_rule() {
                rule.validate()?;
            }
            let target = model.load()?;
            let mut messages: Vec<Message> = system.iter().map(|s| Message::new("system", s)).collect();
            messages.push(Message::new("user", &prompt));
            let ids = target.tokenizer.chat_prompt(&messages)?;
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let (tokens, summary) = if spec.enabled() {
                let kind = match (&spec.draft_kind, &spec.draft) {
                    (Some(k), _) => k.clone(),
                    (None, Some(_)) => DraftKind::Eagle,
                    (None, None) => unreachable!("enabled() checked"),
                };
                let keep = spec.keep_set(&target)?;
                let mut draft = frspec::engine::cpu::draft::build(&kind, spec.draft.as_deref(), &target, &model.model)?;
                let head = DraftHead::new(draft.lm_head(), keep, spec.head)?;
                let kept = head.kept();
                let cfg = SpecConfig { k: spec.k, mode: spec.draft_mode, sampling, max_new_tokens };
                let (tokens, r) = speculative_turn(&target.model, &target.tokenizer.stop_ids, draft.as_mut(), &head, &ids, &cfg, &mut rng)?;
                let summary = format!(
                    "draft: {}, head keeps {kept} of {} ids\nmean acceptance length {:.3}, acceptance rate {:.1}% \
                     ({} accepted of {} draft tokens in {} steps); draft {:.2}s, target {:.2}s",
                    draft.describe(),
                    target.model.config.vocab,
                    r.mean_acceptance_length(),
                    r.acceptance_rate(),
                    r.accepted,
                    r.draft_tokens,
                    r.drafts,
                    r.draft_secs,
                    r.target_secs
                );
                (tokens, summary)
            } else {
                let g = frspec::speculative::generate::generate(&target.model, &target.tokenizer.stop_ids, &ids, max_new_tokens, sampling, &mut rng)?;
                let summary = format!(
                    "prompt {} tokens, {:.1} tokens/s prefill; generated {} tokens, {:.1} tokens/s; stop: {:?}",
                    g.prompt_tokens,
                    g.prompt_tokens as f64 / g.prefill_secs,
                    g.tokens.len(),
                    g.tokens.len() as f64 / g.decode_secs.max(1e-9),
                    g.stop
                );
                (g.tokens, summary)
            };
            let shown: Vec<u32> = tokens.iter().copied().filter(|t| !target.tokenizer.is_stop(*t)).collect();
            println!("{}", target.tokenizer.decode(&shown)?);
            eprintln!("{summary}");
        }
        Command::Score { model, text_file, tokens_file, json, logits_out } => {
            let target = model.load()?;
            let tokens = match (&text_file, &tokens_file) {
                (Some(f), _) => {
                    let text = std::fs::read_to_string(f).with_context(|| format!("cannot read text file {}", f.display()))?;
                    target.tokenizer.encode(&text)?
                }
                (None, Some(f)) => read_token_file(f)?,
                (None, None) => unreachable!("clap requires one of them"),
            };
            let score = frspec::score::score(&target.model, &tokens)?;
            if let Some(path) = &logits_out {
                write_npy(path, &score.logits, &[tokens.len() as u64, target.model.config.vocab as u64])?;
            }
            if json {
                println!("{}", serde_json::to_string(&score)?);
            } else {
                println!("{:>5} {:>8} {:>10} {:>8}", "pos", "next", "logprob", "top1");
                for p in &score.positions {
                    println!("{:>5} {:>8} {:>10.4} {:>8}", p.pos, p.next_token, p.logprob, p.top1);
                }
                println!("perplexity {:.4} over {} positions", score.perplexity, score.positions.len());
            }
        }
        Command::Sweep { spec, config, speculative_config, out, resume, overwrite, quiet } => {
            let file = config.as_deref().map(frspec::spec::SweepSpec::from_toml_file).transpose()?;
            let vllm = match &speculative_config {
                Some(json) => {
                    let (spec, ignored) = frspec::spec::SweepSpec::from_vllm(json)?;
                    if !ignored.is_empty() {
                        eprintln!("note: --speculative-config keys that do not change acceptance are ignored: {}", ignored.join(", "));
                    }
                    Some(spec)
                }
                None => None,
            };
            let settings = frspec::spec::resolve(file.as_ref(), vllm.as_ref(), &spec)?;
            let mode = match (resume, overwrite) {
                (true, _) => FolderMode::Resume,
                (_, true) => FolderMode::Overwrite,
                _ => FolderMode::Fresh,
            };
            let options = frspec::sweep::Options { mode, quiet, command: std::env::args().collect() };
            let outcome = frspec::sweep::execute(&settings, &out, &options)?;
            let draft = settings.draft.as_deref().map_or(settings.draft_kind.to_string(), |d| format!("{} ({d})", settings.draft_kind));
            println!(
                "{} · draft {draft} · freq {} · {} · k = {} · {} turn(s) · ≤ {} new tokens · {} repeat(s), seed {}",
                settings.model,
                settings.freq.as_deref().unwrap_or("-"),
                settings.dataset,
                settings.k,
                settings.turns,
                settings.max_new_tokens,
                settings.repeats,
                settings.seed
            );
            println!("95% bootstrap intervals over prompts; t-intervals over repeats are in summary.parquet");
            print!("{}", frspec::report::table(&outcome.summary, &outcome.timings, false));
            eprintln!(
                "{} units run, {} resumed → {}",
                outcome.units_run,
                outcome.units_resumed,
                out.display()
            );
        }
        Command::TrainEagle {
            target, out, corpus, format, prompts, templates, continuations, self_prompts, max_new_tokens, steps, batch, lr, warmup, weight_decay, checkpoint_every, seed, rollout, classification_weight, teacher_from, freq, ratio, keep, device, quiet,
        } => {
            if device != "cpu" {
                bail!("--device {device}: this build trains on the CPU only (use --device cpu)");
            }
            let keep = ratio.map(KeepRule::Ratio).or(keep.map(KeepRule::Keep));
            if let Some(rule) = keep {
                rule.validate()?;
            }
            let settings = frspec::train::TrainSettings { steps, seed, batch, lr, warmup, weight_decay, checkpoint_every, rollout, classification_weight };
            let freq = freq.as_deref().map(frspec::vocab::freq_path).transpose()?;
            let options = frspec::train::TrainOptions { target, out, corpus, format, prompts, templates, continuations, self_prompts, max_new_tokens, settings, teacher_from, freq, keep, quiet };
            frspec::train::train_eagle(&options)?;
        }
        Command::Plot { dir } => {
            let result = frspec::check::SweepResult::load(&dir)?;
            let timings = result.timings()?;
            let labels = frspec::plot::Labels { title: sweep_title(&result.manifest) };
            for file in frspec::plot::write(&dir.join("plots"), &result.cells, &timings, &labels)? {
                println!("{}", file.display());
            }
        }
        Command::Report { dir, out } => {
            let result = frspec::check::SweepResult::load(&dir)?;
            let timings = result.timings()?;
            let text = format!(
                "{}\n\nValues with 95% bootstrap intervals over prompts; Δ rows are paired differences.\n\n{}",
                sweep_title(&result.manifest),
                frspec::report::table(&result.cells, &timings, true)
            );
            match out {
                Some(path) => std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?,
                None => print!("{text}"),
            }
        }
        Command::Check { baseline, current, metric, tolerance, update_baseline } => {
            if update_baseline {
                frspec::check::update_baseline(&baseline, &current)?;
                println!("baseline {} now holds the summary of {}", baseline.display(), current.display());
                return Ok(());
            }
            let compared = frspec::check::SweepResult::load(&baseline)
                .and_then(|b| Ok((b, frspec::check::SweepResult::load(&current)?)))
                .and_then(|(b, c)| frspec::check::compare(&b, &c, &metric, tolerance));
            let rows = match compared {
                Ok(rows) => rows,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(2);
                }
            };
            print!("{}", frspec::check::table(&rows));
            let regressed: Vec<_> = rows.iter().filter(|r| r.regressed).collect();
            if !regressed.is_empty() {
                eprintln!("regression: {} of {} comparisons fell below the baseline by more than allowed", regressed.len(), rows.len());
                std::process::exit(1);
            }
            eprintln!("pass: {} comparisons within what the tolerance and intervals allow", rows.len());
        }
        Command::SyntheticModel { out, hidden, layers, vocab, seed } => {
            if hidden == 0 || hidden % 64 != 0 || layers == 0 || vocab < 258 {
                bail!("--hidden must be a positive multiple of 64, --layers at least 1 and --vocab at least 258");
            }
            let heads = hidden / 32;
            let shape = frspec::synthetic::Shape { hidden, intermediate: 2 * hidden, layers, heads, kv_heads: heads / 2, vocab, tied: false, qkv_bias: false };
            frspec::synthetic::write_model(&out, &shape, seed, candle_core::DType::F32)?;
            println!("{}", out.display());
        }
        Command::Bench(BenchCommand::Decode {
            model,
            prompt,
            new_tokens,
            runs,
            block,
            sequences,
            shape,
            dtype,
            candle,
            prompt_tokens,
            k,
            ratios,
            lengths,
            compare_engine,
            json,
        }) => {
            if runs == 0 || new_tokens == 0 || block == 0 || k == 0 || sequences == 0 {
                bail!("--runs, --new-tokens, --block, --sequences and --k must be at least 1");
            }
            if model.device == "cpu" && dtype == "f32" && shape.is_none() && !candle {
                let target = model.load()?;
                let b = frspec::bench::decode(&target, &prompt, new_tokens, runs, block, sequences)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&b)?);
                } else {
                    println!("model {} ({} threads, median of {} runs)", target.source.display(), b.threads, b.runs);
                    println!("decode  {:>8.1} tokens/s  ({} new tokens)", b.decode_tok_s, b.new_tokens);
                    println!("prefill {:>8.1} tokens/s  ({} prompt tokens)", b.prefill_tok_s, b.prompt_tokens);
                    println!("block of {} costs {:.2}× a one-token forward", b.block, b.block_cost_ratio);
                    println!("decode  {:>8.1} tokens/s  ({} sequences together, {:.2}× one alone)", b.batched_decode_tok_s, b.sequences, b.batched_decode_tok_s / b.decode_tok_s);
                }
                return Ok(());
            }
            for r in &ratios {
                KeepRule::Ratio(*r).validate()?;
            }
            if lengths.iter().any(|l| !(*l >= 1.0)) {
                bail!("--lengths: every mean acceptance length is at least 1");
            }
            let device = frspec::engine::candle::device(&model.device)?;
            let dt = frspec::engine::candle::dtype(&dtype)?;
            let (llama, engine, tokens, weights) = match &shape {
                Some(name) => {
                    if compare_engine {
                        bail!("--compare-engine needs --model (random weights exist on the device only)");
                    }
                    let shape = frspec::engine::candle::llama::named_shape(name)?;
                    let tokens = frspec::bench::device::synthetic_prompt(prompt_tokens, shape.vocab);
                    (frspec::engine::candle::llama::Llama::random(&shape, &device, dt)?, None, tokens, "random".to_string())
                }
                None => {
                    let target = Target::load(&model.model)?;
                    let tokens = target.tokenizer.chat_prompt(&[Message::new("user", &prompt)])?;
                    let llama = frspec::engine::candle::llama::Llama::from_engine(&target.model, &device, dt)?;
                    (llama, compare_engine.then_some(target.model), tokens, target.source.display().to_string())
                }
            };
            if tokens.len() < 2 {
                bail!("the prompt must have at least 2 tokens (the draft pairs each with the next)");
            }
            let settings = frspec::bench::device::DecodeSettings { device: &model.device, prompt: &tokens, new_tokens, runs, k, ratios: &ratios, acceptance_lengths: &lengths };
            let b = frspec::bench::device::decode(&llama, &weights, &settings, engine.as_ref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&b)?);
            } else {
                println!("{} on {} in {} ({} weights; median of {} runs)", frspec::bench::device::describe(&llama.config), b.device, b.dtype, b.weights, b.runs);
                println!(
                    "decode  {:>9.1} tokens/s  ({} new tokens after {}); weights streamed at {:.1} GB/s = {:.1}% of the measured {:.1} GB/s",
                    b.decode_tok_s,
                    b.new_tokens,
                    b.prompt_tokens,
                    b.decode_bytes_per_sec / 1e9,
                    100.0 * b.bandwidth_share,
                    b.device_bytes_per_sec / 1e9
                );
                println!("prefill {:>9.1} tokens/s", b.prefill_tok_s);
                println!("verify  {:>9.3} ms for {} tokens (one-token step {:.3} ms)", 1e3 * b.verify_secs, k + 1, 1e3 * b.decode_step_secs);
                let header: Vec<String> = lengths.iter().map(|l| format!("tok/s@{l}")).collect();
                println!(
                    "{:>6} {:>8} {:>10} {:>10} {:>11} {:>11} {}",
                    "ratio",
                    "kept",
                    "draft ms",
                    "step ms",
                    "loop tok/s",
                    "break-even",
                    header.iter().map(|h| format!("{h:>11}")).collect::<String>()
                );
                for d in &b.drafts {
                    let projected: String = d.projected_tok_s.iter().map(|t| format!("{t:>11.1}")).collect();
                    let (draft_ms, step_ms) = (1e3 * d.draft_step_secs, 1e3 * d.speculative_step_secs);
                    println!("{:>6} {:>8} {draft_ms:>10.3} {step_ms:>10.3} {:>11.1} {:>11.2} {projected}", d.ratio, d.kept, d.loop_tok_s, d.break_even_length);
                }
                if let Some(a) = &b.agreement {
                    match a.first_difference {
                        None => println!("greedy tokens: {} of {} identical to the CPU engine's", a.device.len(), a.engine.len()),
                        Some(i) => println!("greedy tokens: differ from the CPU engine's at position {i} of {}", a.engine.len()),
                    }
                }
            }
            if b.agreement.as_ref().is_some_and(|a| a.first_difference.is_some()) {
                std::process::exit(1);
            }
        }
        Command::Bench(BenchCommand::Head { hidden, vocab, batch, ratios, dtype, device, out }) => {
            if hidden == 0 || vocab == 0 || batch.is_empty() || batch.contains(&0) {
                bail!("--hidden, --vocab and every --batch must be at least 1");
            }
            for r in &ratios {
                KeepRule::Ratio(*r).validate()?;
            }
            // `ran_on` ends the plot's title: where and through what the products ran.
            let (roof, points, ran_on) = if device == "cpu" {
                if hidden % 32 != 0 {
                    bail!("--hidden must be a multiple of 32 (the CPU kernels' block size), got {hidden}");
                }
                let roof = frspec::bench::roofline()?;
                let threads = frspec::engine::cpu::tensor::pool().current_num_threads();
                (roof, frspec::bench::head(hidden, vocab, &batch, &ratios, &dtype, roof)?, format!("{threads} threads, frspec kernel"))
            } else {
                let (dev, dt) = (frspec::engine::candle::device(&device)?, frspec::engine::candle::dtype(&dtype)?);
                let roof = frspec::bench::device::roofline(&dev, dt)?;
                (roof, frspec::bench::device::head(hidden, vocab, &batch, &ratios, &dev, dt, roof)?, format!("{device}, candle matmul"))
            };
            println!(
                "H = {hidden}, V = {vocab}, {dtype} weights on {device}; roofline there: {:.1} GB/s, {:.1} GFLOP/s",
                roof.bytes_per_sec / 1e9,
                roof.flops_per_sec / 1e9
            );
            println!("{:>6} {:>8} {:>6} {:>12} {:>10} {:>10} {:>10} {:>9}", "ratio", "kept", "batch", "median ms", "GB/s", "GFLOP/s", "FLOP/B", "roofline");
            for p in &points {
                println!(
                    "{:>6} {:>8} {:>6} {:>12.4} {:>10.2} {:>10.2} {:>10.2} {:>8.1}%",
                    p.ratio, p.kept, p.batch, 1e3 * p.median_secs, p.bytes_per_sec / 1e9, p.flops_per_sec / 1e9, p.intensity, 100.0 * p.roofline_share
                );
            }
            if let Some(dir) = out {
                std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
                frspec::store::write_head_bench(&dir.join("head.parquet"), &points)?;
                let title = format!("H = {hidden}, V = {vocab}, {dtype} weights, {ran_on}");
                frspec::plot::head_latency(&dir.join("head_latency"), &points, &title)?;
            }
        }
        Command::Bench(BenchCommand::Draft { model, draft, draft_kind, freq, ratios, k, reps, json }) => {
            if k == 0 || reps == 0 {
                bail!("--k and --reps must be at least 1");
            }
            for r in &ratios {
                KeepRule::Ratio(*r).validate()?;
            }
            let target = model.load()?;
            let freqs = Frequencies::open(&freq)?;
            let mut d = frspec::engine::cpu::draft::build(&draft_kind, draft.as_deref(), &target, &model.model)?;
            let rows = frspec::bench::draft_heads(&target, d.as_mut(), &freqs, &ratios, k, reps, "What is the capital of France?")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                let full = &rows[0];
                println!("draft: {} (k = {k}, median of {reps})", d.describe());
                println!("{:>6} {:>6} {:>8} {:>7} {:>11} {:>12} {:>15} {:>12}", "ratio", "head", "kept", "kept %", "head ms", "head ÷ full", "draft step ms", "step ÷ full");
                for r in &rows {
                    println!(
                        "{:>6} {:>6} {:>8} {:>6.1}% {:>11.3} {:>12.3} {:>15.3} {:>12.3}",
                        r.ratio, r.head, r.kept, 100.0 * r.kept as f64 / target.model.config.vocab as f64,
                        1e3 * r.head_secs, r.head_secs / full.head_secs, 1e3 * r.draft_step_secs, r.draft_step_secs / full.draft_step_secs
                    );
                }
            }
        }
        Command::Bench(BenchCommand::FastPath { model, draft, draft_kind, freq, ratios, dataset, num_prompts, k, max_new_tokens }) => {
            if k == 0 || num_prompts == 0 || max_new_tokens == 0 {
                bail!("--k, --num-prompts and --max-new-tokens must be at least 1");
            }
            for r in &ratios {
                KeepRule::Ratio(*r).validate()?;
            }
            let target = model.load()?;
            let freqs = Frequencies::open(&freq)?;
            let questions = frspec::dataset::load(&dataset)?;
            let prompts = questions
                .iter()
                .take(num_prompts)
                .map(|q| target.tokenizer.chat_prompt(&[Message::new("user", &q.turns[0])]))
                .collect::<Result<Vec<_>>>()?;
            let mut make = || frspec::engine::cpu::draft::build(&draft_kind, draft.as_deref(), &target, &model.model);
            let b = frspec::bench::fast_path(&target, &mut make, &freqs, &ratios, &prompts, k, max_new_tokens)?;
            println!(
                "{} ratios × {} prompts, k = {k}, T = 0: independent loops {:.1} s, fast path {:.1} s ({:.2}× faster); counts agree: {}",
                b.ratios.len(), b.prompts, b.independent_secs, b.fast_path_secs, b.independent_secs / b.fast_path_secs, b.counts_agree
            );
        }
        Command::Freq(FreqCommand::Build { tokenizer, corpus, format, out }) => freq_build(&tokenizer, &corpus, format, &out)?,
        Command::Freq(FreqCommand::FromOutputs { model, dataset, num_prompts, max_new_tokens, out }) => {
            let mut questions = frspec::dataset::load(&dataset)?;
            if let Some(n) = num_prompts {
                if n == 0 {
                    bail!("--num-prompts must be at least 1");
                }
                questions.truncate(n);
            }
            let target = model.load()?;
            let vocab = target.model.config.vocab;
            let mut counts = vec![0u64; vocab];
            let bar = indicatif::ProgressBar::new(questions.len() as u64);
            let mut rng = ChaCha20Rng::seed_from_u64(0);
            for q in &questions {
                let prompt = target.tokenizer.chat_prompt(&[Message::new("user", &q.turns[0])])?;
                let g = frspec::speculative::generate::generate(&target.model, &target.tokenizer.stop_ids, &prompt, max_new_tokens, Sampling::GREEDY, &mut rng)?;
                g.tokens.iter().for_each(|&t| counts[t as usize] += 1);
                bar.inc(1);
            }
            bar.finish();
            let corpus = format!("greedy outputs of {} on {dataset} ({} first turns, ≤ {max_new_tokens} tokens)", model.model, questions.len());
            let freq = Frequencies::counted(&counts, &model.model, target.tokenizer.vocab_hash(), corpus, &out);
            freq.save(&out)?;
            eprintln!("{} generated tokens → {}", freq.metadata["tokens"], out.display());
        }
        Command::Freq(FreqCommand::Show { file, ratios, vocab }) => {
            let f = Frequencies::load(&file)?;
            let vocab = match vocab.or_else(|| f.metadata.get("vocab").and_then(|v| v.parse().ok())) {
                Some(v) => v,
                None => bail!("{}: no vocabulary size in the file: pass --vocab", file.display()),
            };
            let mut meta: Vec<_> = f.metadata.iter().collect();
            meta.sort();
            for (k, v) in meta {
                println!("{k}: {v}");
            }
            println!("{:>7} {:>8} {:>10}", "ratio", "kept", "coverage");
            for r in ratios {
                KeepRule::Ratio(r).validate()?;
                let kept = frspec::vocab::kept_for_ratio(r, vocab);
                let cov = f.coverage(kept).ok_or_else(|| anyhow::anyhow!("{} has no counts", file.display()))?;
                println!("{r:>7} {kept:>8} {:>9.2}%", 100.0 * cov);
            }
        }
    }
    Ok(())
}

/// One line naming what a sweep measured, from its manifest.
fn sweep_title(manifest: &serde_json::Value) -> String {
    let s = &manifest["settings"];
    let text = |key: &str| s[key].as_str().unwrap_or("-").to_string();
    let draft = match s["draft"].as_str() {
        Some(d) => format!("{} {d}", text("draft_kind")),
        None => text("draft_kind"),
    };
    format!("{} · draft {draft} · freq {} · {} · k = {}", text("model"), text("freq"), text("dataset"), s["k"])
}

fn freq_build(tokenizer: &str, corpus: &[PathBuf], format: CorpusFormat, out: &std::path::Path) -> Result<()> {
    let tok = frspec::tokenizer::Tokenizer::load(tokenizer)?;
    let files = frspec::vocab::corpus_files(corpus)?;
    let bar = indicatif::ProgressBar::new(files.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} files, {msg} tokens, {elapsed} (ETA {eta})")?,
    );
    let mut counts = vec![0u64; tok.vocab_size];
    for f in &files {
        let lines = frspec::vocab::corpus_lines(f, format)?;
        let c = frspec::vocab::count_tokens(&tok, &lines, tok.vocab_size)?;
        counts.iter_mut().zip(c).for_each(|(a, b)| *a += b);
        bar.set_message(counts.iter().sum::<u64>().to_string());
        bar.inc(1);
    }
    bar.finish();
    let total: u64 = counts.iter().sum();
    if total == 0 {
        bail!("the corpus ({} files) holds no tokens", files.len());
    }
    let names = corpus.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(" ");
    let mut freq = Frequencies::counted(&counts, tokenizer, tok.vocab_hash(), names, out);
    freq.metadata.insert("corpus_files".into(), files.len().to_string());
    freq.save(out)?;
    eprintln!("{} tokens, {} distinct ids → {}", total, freq.metadata["distinct_ids"], out.display());
    Ok(())
}

fn read_token_file(path: &std::path::Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read tokens file {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: expected a JSON array of token ids", path.display()))
}

fn write_npy(path: &std::path::Path, values: &[f32], shape: &[u64]) -> Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    use npyz::WriterBuilder;
    let mut w = npyz::WriteOptions::<f32>::new().default_dtype().shape(shape).writer(std::io::BufWriter::new(file)).begin_nd()?;
    w.extend(values.iter().copied())?;
    w.finish()?;
    Ok(())
}
