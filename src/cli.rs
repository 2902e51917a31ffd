//! The command line: what each subcommand takes. Parsing only; `main` dispatches and `frspec::commands` does the work.

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use frspec::loading::target::{Target, DEFAULT_MODEL};
use frspec::speculative::{DraftKind, DraftMode, HeadMode};
use frspec::vocab::{CorpusFormat, Frequencies, KeepRule, KeepSet};
use std::path::PathBuf;

/// A pruning ratio, checked where it is parsed: every `--ratio` and `--ratios` flag goes through here.
fn ratio(text: &str) -> std::result::Result<f64, String> {
    let r: f64 = text.parse().map_err(|_| format!("`{text}` is not a number"))?;
    KeepRule::Ratio(r).validate().map_err(|e| e.to_string())?;
    Ok(r)
}

fn ratio_pair(text: &str) -> std::result::Result<frspec::outputs::compare::RatioPair, String> {
    let (a, b) = text.split_once('=').ok_or_else(|| format!("`{text}` is not BASE=OTHER (two ratios)"))?;
    Ok((ratio(a)?, ratio(b)?))
}

fn shard(text: &str) -> std::result::Result<frspec::sweep::shard::Shard, String> {
    frspec::sweep::shard::Shard::parse(text).map_err(|e| e.to_string())
}

#[derive(Parser)]
#[command(name = "frspec", version, args_override_self = true, about = "Measure what FR-Spec vocabulary pruning does to speculative-decoding acceptance")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Args)]
pub struct ModelArgs {
    /// A named offline asset (smollm2), a .gguf/.safetensors file, a model folder, or a hub repo id (org/name[@rev]).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Compute device: cpu; `bench decode` also takes cuda[:N] (the candle engine).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Target> {
        if self.device != "cpu" {
            bail!("--device {}: this command runs on the CPU engine only (use --device cpu; sweep and bench decode run on a GPU)", self.device);
        }
        Target::load(&self.model)
    }
}

/// Speculative decoding: the draft, its pruned head and how it proposes.
#[derive(clap::Args)]
pub struct SpecArgs {
    /// Draft: an EAGLE-1 head folder or repo, or a draft model; absent with --draft-kind truncated:N.
    #[arg(long)]
    pub draft: Option<String>,
    /// eagle | eagle3 | model | truncated:N. Without it and without --draft, decoding is target-only.
    #[arg(long)]
    pub draft_kind: Option<DraftKind>,
    /// Token frequencies that rank the vocabulary for pruning (frspec, FR-Spec or vLLM format), or a named one
    /// such as brown-smollm2.
    #[arg(long)]
    pub freq: Option<String>,
    /// Fraction of the vocabulary to prune from the draft head, in [0, 1).
    #[arg(long, conflicts_with_all = ["keep", "mass"], value_parser = ratio)]
    pub ratio: Option<f64>,
    /// Number of most frequent ids the draft head keeps.
    #[arg(long, conflicts_with = "mass")]
    pub keep: Option<usize>,
    /// Keep the most frequent ids until they cover this share of the counted tokens, in (0, 1].
    #[arg(long)]
    pub mass: Option<f64>,
    /// Draft tokens per step.
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    #[arg(long, value_enum, default_value = "argmax")]
    pub draft_mode: DraftMode,
    #[arg(long, value_enum, default_value = "slice")]
    pub head: HeadMode,
}

impl SpecArgs {
    pub fn keep_rule(&self) -> Option<KeepRule> {
        match (self.ratio, self.keep, self.mass) {
            (Some(r), _, _) => Some(KeepRule::Ratio(r)),
            (_, Some(k), _) => Some(KeepRule::Keep(k)),
            (_, _, Some(m)) => Some(KeepRule::Mass(m)),
            _ => None,
        }
    }

    /// The keep set for `target`, or None for the full head.
    pub fn keep_set(&self, target: &Target) -> Result<Option<KeepSet>> {
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
pub enum Command {
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
        /// Run only shard I of N of the units (I from 0), e.g. one task of a job array; `slurm` takes I and N from
        /// the Slurm array task. Each shard writes its own --out; `frspec merge` joins them.
        #[arg(long, value_parser = shard)]
        shard: Option<frspec::sweep::shard::Shard>,
    },
    /// Join the folders of a sharded sweep (`sweep --shard I/N`) into the folder one machine would have written.
    Merge {
        /// The merged sweep's folder (must not hold anything).
        #[arg(long)]
        out: PathBuf,
        /// Every shard's folder, one per shard.
        #[arg(required = true)]
        shards: Vec<PathBuf>,
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
    /// Two sweeps of the same prompts side by side (another head, engine or setting): each cell's mean acceptance
    /// length in both and the paired difference (other − base) with its bootstrap interval over prompts.
    Compare {
        /// The base sweep folder (runs.parquet).
        base: PathBuf,
        /// The sweep compared with it.
        other: PathBuf,
        /// Pair the base sweep's ratio A with the other's ratio B (A=B, as reports print ratios) instead of equal
        /// ratios: a draft at full vocabulary against a pruned one, say. Repeatable; the table follows their order.
        #[arg(long, value_parser = ratio_pair)]
        pair: Vec<frspec::outputs::compare::RatioPair>,
        /// Follow each cell's row with one per category of the base sweep's prompts (MT-Bench's eight), each
        /// paired over that category's prompts only.
        #[arg(long)]
        by_category: bool,
        /// Write the Markdown table to this file instead of stdout.
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
        metric: Vec<frspec::outputs::check::CheckMetric>,
        /// The drop always allowed, as a share of the baseline value; the confidence intervals may allow more.
        #[arg(long, default_value_t = 0.01)]
        tolerance: f64,
        /// Make the current sweep the baseline (copies its summary and manifest) instead of checking.
        #[arg(long)]
        update_baseline: bool,
    },
    /// Train an EAGLE-1 or EAGLE-3 head for a target on its own answers to prompts (from a corpus, ShareGPT or the
    /// target itself); resumable.
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
        /// Conversations the target answers for training, their prompts made from corpus passages (0: none).
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
        /// Conversations opened by ShareGPT users' requests (the first distinct ones of at most 512 tokens, in file
        /// order), answered by the target, mixed into the training data.
        #[arg(long, default_value_t = 0)]
        sharegpt: usize,
        /// Conversations continued by ShareGPT users' later requests, each with the turns before it as ShareGPT
        /// recorded them (the first distinct ones whose chat is at most 512 tokens, in file order), answered by the
        /// target, mixed into the training data.
        #[arg(long, default_value_t = 0)]
        sharegpt_follow_ups: usize,
        /// The ShareGPT file (a JSON list of conversations; a file cut off mid-record gives its complete ones); the
        /// named asset sharegpt (scripts/fetch-assets.sh sharegpt) when absent.
        #[arg(long)]
        sharegpt_file: Option<PathBuf>,
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
        /// Training-time test (EAGLE-3): after the pass on true features, unroll this many further draft steps, each
        /// fed the features the step before predicted, trained through. Each step costs about one more pass.
        #[arg(long, default_value_t = 0)]
        unroll: usize,
        /// Weight of unrolled step j: this to the power j (EAGLE-3's 0.8).
        #[arg(long, default_value_t = frspec::train::EAGLE3_UNROLL_DECAY)]
        unroll_decay: f64,
        /// Weight of the cross-entropy against the target's next-token distribution (forward KL plus a constant)
        /// beside the feature regression: EAGLE-1's 0.1 by default, 1 (the whole objective) for --arch eagle3.
        #[arg(long)]
        classification_weight: Option<f64>,
        /// Weight of the feature regression: EAGLE-1's 1 by default (0 trains on the token distribution alone);
        /// an EAGLE-3 head has none.
        #[arg(long)]
        feature_weight: Option<f64>,
        /// The head trained: eagle1 (fc over embedding and final feature, the target's LM head) or eagle3 (fc over
        /// three of the target's residual streams, its own norm and LM head over a draft vocabulary).
        #[arg(long, value_enum, default_value = "eagle1")]
        arch: frspec::train::Arch,
        /// EAGLE-3's draft vocabulary: this many of the ids the target's answers hold most often (default: a quarter
        /// of the target's vocabulary, EAGLE-3's 32k of Llama-3's 128k).
        #[arg(long)]
        draft_vocab: Option<usize>,
        /// Reuse the teacher data of another training folder made from the same target, corpus and seed, in as many
        /// conversations or more (then its first ones), or in fewer (then the rest made here; self-prompted requests
        /// are all written again and the cached ones must come out first, but only the new ones are answered).
        #[arg(long)]
        teacher_from: Option<PathBuf>,
        /// Start from this head (a folder train-eagle exported, or one packed as heads ship, its Q8_0 matrices
        /// dequantized) instead of initial weights: its weights, fresh
        /// optimizer moments and a schedule of this run's own; an EAGLE-3 head keeps its draft vocabulary.
        #[arg(long)]
        init_from: Option<PathBuf>,
        /// Train against a pruned vocabulary ranked by these frequencies (a file or a named one such as
        /// brown-smollm2; with --ratio or --keep).
        #[arg(long)]
        freq: Option<String>,
        #[arg(long, conflicts_with = "keep", value_parser = ratio)]
        ratio: Option<f64>,
        #[arg(long)]
        keep: Option<usize>,
        /// Compute device. Training runs on the CPU only in this build.
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long)]
        quiet: bool,
    },
    /// Pack a head folder (config.json + model.safetensors) as this repository ships heads in the binary: its
    /// matrices in Q8_0, in one model.gguf beside config.json. Drafts read either folder.
    PackHead {
        /// The head folder, as train-eagle writes it.
        head: PathBuf,
        #[arg(long)]
        out: PathBuf,
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
        /// Also write an EAGLE-1 head built from the model's first layer (it drafts well enough for sweeps of two
        /// engines to be compared).
        #[arg(long)]
        eagle_head: Option<PathBuf>,
        /// Also write an EAGLE-3 head built the same way, over a draft vocabulary without every seventh id.
        #[arg(long)]
        eagle3_head: Option<PathBuf>,
    },
    /// Token-frequency files that rank the vocabulary for pruning.
    #[command(subcommand)]
    Freq(FreqCommand),
}

#[derive(Subcommand)]
pub enum FreqCommand {
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
        /// A frequency file or a named one such as brown-smollm2.
        file: String,
        #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75,0.9,0.95,0.99", value_parser = ratio)]
        ratios: Vec<f64>,
        /// The vocabulary the ratios apply to (default: the file's own).
        #[arg(long)]
        vocab: Option<usize>,
        /// Also the share of this frequency file's tokens that each keep set holds (the target's own answers from
        /// `freq from-outputs`, say): what a keep set covers of the text it will draft, not of its own corpus.
        #[arg(long)]
        on: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum BenchCommand {
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
        #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.75,0.9,0.99", value_parser = ratio)]
        ratios: Vec<f64>,
        /// Mean acceptance lengths at which to project speculative tokens/s.
        #[arg(long, value_delimiter = ',', default_value = "1.5,2,2.5,3")]
        lengths: Vec<f64>,
        /// Candle backend: sequences the batched speculative loop decodes together, each measured.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
        batches: Vec<usize>,
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
        #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,0.9,0.95,0.99", value_parser = ratio)]
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
        #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.75,0.9,0.99", value_parser = ratio)]
        ratios: Vec<f64>,
        /// Weight dtype: on the CPU f32, f16, q4_0, q4_1, q8_0, q4_k, q5_k or q6_k, meeting the activations as the
        /// engine's products do (`FRSPEC_ACTIVATIONS`, 8-bit by default).
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
        #[arg(long, value_delimiter = ',', default_value = "0.5,0.75,0.9,0.99", value_parser = ratio)]
        ratios: Vec<f64>,
        #[arg(long, default_value_t = 4)]
        k: usize,
        #[arg(long, default_value_t = 50)]
        reps: usize,
        #[arg(long)]
        json: bool,
    },
}
