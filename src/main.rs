//! Parse the command line and dispatch to `frspec::commands` and the library; what each command prints stays here.

use anyhow::{bail, Context, Result};
use clap::Parser;
use frspec::commands::sweep::FolderMode;
use frspec::commands::{freq, generate, score};
use frspec::loading::target::Target;
use frspec::sampling::Sampling;
use frspec::speculative::DraftKind;
use frspec::text::chat::Message;
use frspec::vocab::{Frequencies, KeepRule};

mod cli;
use cli::{BenchCommand, Cli, Command, FreqCommand};

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
            let speculative = match (&spec.draft_kind, &spec.draft) {
                (None, None) => None,
                (kind, draft) => Some(generate::Speculative {
                    kind: kind.clone().unwrap_or(DraftKind::Eagle),
                    draft: draft.as_deref(),
                    keep: spec.keep_set(&target)?,
                    head: spec.head,
                    k: spec.k,
                    mode: spec.draft_mode,
                }),
            };
            let request = generate::Request { prompt: &prompt, system: system.as_deref(), max_new_tokens, sampling, seed, speculative };
            generate::run(&target, &model.model, &request)?;
        }
        Command::Score { model, text_file, tokens_file, json, logits_out } => {
            let input = match (&text_file, &tokens_file) {
                (Some(f), _) => score::Input::Text(f),
                (None, Some(f)) => score::Input::Tokens(f),
                (None, None) => unreachable!("clap requires one of them"),
            };
            score::run(&model.load()?, input, json, logits_out.as_deref())?;
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
            let options = frspec::commands::sweep::Options { mode, quiet, command: std::env::args().collect() };
            let outcome = frspec::commands::sweep::execute(&settings, &out, &options)?;
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
            print!("{}", frspec::outputs::report::table(&outcome.summary, &outcome.timings, false));
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
            if let Some(t) = frspec::train::train_eagle(&options)? {
                frspec::outputs::plot::training_curve(&options.out.join("training_curve"), &t.log, &t.title, t.classification_weight)?;
            }
        }
        Command::Plot { dir } => {
            let result = frspec::outputs::check::SweepResult::load(&dir)?;
            let timings = result.timings()?;
            let labels = frspec::outputs::plot::Labels { title: frspec::outputs::report::title(&result.manifest) };
            for file in frspec::outputs::plot::write(&dir.join("plots"), &result.cells, &timings, &labels)? {
                println!("{}", file.display());
            }
        }
        Command::Report { dir, out } => {
            let result = frspec::outputs::check::SweepResult::load(&dir)?;
            let timings = result.timings()?;
            let text = format!(
                "{}\n\nValues with 95% bootstrap intervals over prompts; Δ rows are paired differences.\n\n{}",
                frspec::outputs::report::title(&result.manifest),
                frspec::outputs::report::table(&result.cells, &timings, true)
            );
            match out {
                Some(path) => std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?,
                None => print!("{text}"),
            }
        }
        Command::Check { baseline, current, metric, tolerance, update_baseline } => {
            if update_baseline {
                frspec::outputs::check::update_baseline(&baseline, &current)?;
                println!("baseline {} now holds the summary of {}", baseline.display(), current.display());
                return Ok(());
            }
            let compared = frspec::outputs::check::SweepResult::load(&baseline)
                .and_then(|b| Ok((b, frspec::outputs::check::SweepResult::load(&current)?)))
                .and_then(|(b, c)| frspec::outputs::check::compare(&b, &c, &metric, tolerance));
            let rows = match compared {
                Ok(rows) => rows,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(2);
                }
            };
            print!("{}", frspec::outputs::check::table(&rows));
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
                frspec::outputs::store::write_head_bench(&dir.join("head.parquet"), &points)?;
                let title = format!("H = {hidden}, V = {vocab}, {dtype} weights, {ran_on}");
                frspec::outputs::plot::head_latency(&dir.join("head_latency"), &points, &title)?;
            }
        }
        Command::Bench(BenchCommand::Draft { model, draft, draft_kind, freq, ratios, k, reps, json }) => {
            if k == 0 || reps == 0 {
                bail!("--k and --reps must be at least 1");
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
            let target = model.load()?;
            let freqs = Frequencies::open(&freq)?;
            let questions = frspec::text::dataset::load(&dataset)?;
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
        Command::Freq(FreqCommand::Build { tokenizer, corpus, format, out }) => freq::build(&tokenizer, &corpus, format, &out)?,
        Command::Freq(FreqCommand::FromOutputs { model, dataset, num_prompts, max_new_tokens, out }) => {
            freq::from_outputs(&model.load()?, &model.model, &dataset, num_prompts, max_new_tokens, &out)?
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
                let kept = frspec::vocab::kept_for_ratio(r, vocab);
                let cov = f.coverage(kept).ok_or_else(|| anyhow::anyhow!("{} has no counts", file.display()))?;
                println!("{r:>7} {kept:>8} {:>9.2}%", 100.0 * cov);
            }
        }
    }
    Ok(())
}
