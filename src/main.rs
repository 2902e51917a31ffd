//! Parse the command line and dispatch to `frspec::commands` and the library; what each command prints stays here.

use anyhow::{bail, Context, Result};
use clap::Parser;
use frspec::commands::sweep::FolderMode;
use frspec::commands::{bench, freq, generate, score};
use frspec::sampling::Sampling;
use frspec::speculative::DraftKind;
use frspec::vocab::KeepRule;

mod cli;
use cli::{BenchCommand, Cli, Command, FreqCommand};

fn main() {
    if let Err(e) = run(Cli::parse()) {
        report(&e);
        std::process::exit(1);
    }
}

/// What a sweep measured, its table, and where it went (a shard: only where; its table comes with the merge).
fn print_sweep(settings: &frspec::spec::Settings, outcome: &frspec::commands::sweep::Outcome, done: &str, out: &std::path::Path) {
    if let Some(shard) = settings.shard {
        eprintln!("shard {shard}: {done} → {} (join the shards with frspec merge)", out.display());
        return;
    }
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
    eprintln!("{done} → {}", out.display());
}

/// An error is one line, whatever the library below wrote into its message (npyz draws a caret diagram).
fn report(e: &anyhow::Error) {
    let text = format!("{e:#}");
    eprintln!("error: {}", text.split('\n').map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" "));
}

fn run(cli: Cli) -> Result<()> {
    // A mistyped FRSPEC_ACTIVATIONS is refused here rather than ignored where the first product reads it.
    frspec::engine::cpu::tensor::Activations::from_env_checked()?;
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
        Command::Sweep { spec, config, speculative_config, out, resume, overwrite, quiet, shard } => {
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
            let settings = frspec::spec::Settings { shard, ..frspec::spec::resolve(file.as_ref(), vllm.as_ref(), &spec)? };
            let mode = match (resume, overwrite) {
                (true, _) => FolderMode::Resume,
                (_, true) => FolderMode::Overwrite,
                _ => FolderMode::Fresh,
            };
            let options = frspec::commands::sweep::Options { mode, quiet, command: std::env::args().collect() };
            let outcome = frspec::commands::sweep::execute(&settings, &out, &options)?;
            let done = format!("{} units run, {} resumed", outcome.units_run, outcome.units_resumed);
            print_sweep(&settings, &outcome, &done, &out);
        }
        Command::Merge { out, shards } => {
            let options = frspec::commands::sweep::Options { mode: FolderMode::Fresh, quiet: true, command: std::env::args().collect() };
            let (settings, outcome) = frspec::commands::sweep::merge(&shards, &out, &options)?;
            print_sweep(&settings, &outcome, &format!("{} units joined from {} shards", outcome.units_resumed, shards.len()), &out);
        }
        Command::TrainEagle {
            target, out, corpus, format, prompts, templates, continuations, self_prompts, sharegpt, sharegpt_follow_ups, sharegpt_file, max_new_tokens, steps, batch, lr, warmup, weight_decay, checkpoint_every, seed, unroll, unroll_decay, classification_weight, feature_weight, arch, draft_vocab, teacher_from, init_from, freq, ratio, keep, device, quiet,
        } => {
            if device != "cpu" {
                bail!("--device {device}: this build trains on the CPU only (use --device cpu)");
            }
            let keep = ratio.map(KeepRule::Ratio).or(keep.map(KeepRule::Keep));
            if let Some(rule) = keep {
                rule.validate()?;
            }
            if draft_vocab.is_some() && arch != frspec::train::Arch::Eagle3 {
                bail!("--draft-vocab is the draft vocabulary of an EAGLE-3 head: it needs --arch eagle3");
            }
            let (default_features, default_tokens) = arch.loss_weights();
            let settings = frspec::train::TrainSettings {
                steps,
                seed,
                batch,
                lr,
                warmup,
                weight_decay,
                checkpoint_every,
                classification_weight: classification_weight.unwrap_or(default_tokens),
                feature_weight: feature_weight.unwrap_or(default_features),
                unroll,
                unroll_decay,
                arch,
                // 0: a quarter of the target's vocabulary, which is known once the target is loaded.
                draft_vocab: draft_vocab.unwrap_or(0),
            };
            let options = frspec::train::TrainOptions {
                target, out, corpus, format, prompts, templates, continuations, self_prompts, sharegpt, sharegpt_follow_ups, sharegpt_file, max_new_tokens, settings, teacher_from, init_from, freq, keep,
                quiet,
            };
            if let Some(t) = frspec::train::train_eagle(&options)? {
                frspec::outputs::plot::training_curve(&options.out.join("training_curve"), &t.log, &t.title, &t.settings)?;
            }
        }
        Command::PackHead { head, out } => {
            let bytes = frspec::loading::pack::pack(&head, &out)?;
            println!("{} ({bytes} bytes)", out.join(frspec::loading::pack::PACKED).display());
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
            let mut text = format!(
                "{}\n\nValues with 95% bootstrap intervals over prompts; Δ rows are paired differences.\n\n{}",
                frspec::outputs::report::title(&result.manifest),
                frspec::outputs::report::table(&result.cells, &timings, true)
            );
            // The per-category table needs the runs; a folder of the summary alone still reports.
            let runs = match dir.join(frspec::outputs::store::RUNS).exists() {
                true => frspec::outputs::compare::runs(&dir)?,
                false => Vec::new(),
            };
            if let Some(table) = frspec::outputs::report::category_table(&runs, frspec::stats::Bootstrap::default())? {
                text += &format!("\n## By category\n\nEach category's prompts alone; Δ rows are paired over them.\n\n{table}");
            }
            match out {
                Some(path) => std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?,
                None => print!("{text}"),
            }
        }
        Command::Compare { base, other, pair, by_category, out } => {
            use frspec::outputs::compare;
            let rows = compare::compare(&compare::runs(&base)?, &compare::runs(&other)?, &pair, by_category, frspec::stats::Bootstrap::default())?;
            let name = |p: &std::path::Path| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
            let table = compare::table(&rows, &name(&base), &name(&other));
            match out {
                Some(path) => frspec::files::write_atomic(&path, table.as_bytes())?,
                None => print!("{table}"),
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
                    report(&e);
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
        Command::SyntheticModel { out, hidden, layers, vocab, seed, eagle_head, eagle3_head } => {
            if hidden == 0 || hidden % 64 != 0 || layers == 0 || vocab < 258 {
                bail!("--hidden must be a positive multiple of 64, --layers at least 1 and --vocab at least 258");
            }
            if eagle3_head.is_some() && layers < 4 {
                bail!("--eagle3-head needs --layers at least 4 (an EAGLE-3 head reads three of the target's layers)");
            }
            // Every folder made before anything is written, so a bad path leaves no model without its heads.
            for dir in std::iter::once(&out).chain(&eagle_head).chain(&eagle3_head) {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
            }
            let heads = hidden / 32;
            let shape = frspec::synthetic::Shape { hidden, intermediate: 2 * hidden, layers, heads, kv_heads: heads / 2, vocab, tied: false, qkv_bias: false };
            frspec::synthetic::write_model(&out, &shape, seed, candle_core::DType::F32)?;
            println!("{}", out.display());
            use frspec::synthetic::HeadKind;
            for (dir, kind) in [(eagle_head, HeadKind::Eagle1), (eagle3_head, HeadKind::Eagle3)] {
                if let Some(dir) = dir {
                    frspec::synthetic::write_first_layer_head(&dir, &shape, seed, kind)?;
                    println!("{}", dir.display());
                }
            }
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
            batches,
            compare_engine,
            json,
        }) => {
            let request = bench::Decode {
                model: &model.model,
                device: &model.device,
                prompt: &prompt,
                new_tokens,
                runs,
                block,
                sequences,
                shape: shape.as_deref(),
                dtype: &dtype,
                candle,
                prompt_tokens,
                k,
                ratios: &ratios,
                lengths: &lengths,
                batches: &batches,
                compare_engine,
                json,
            };
            if !bench::decode(&request)? {
                std::process::exit(1);
            }
        }
        Command::Bench(BenchCommand::Head { hidden, vocab, batch, ratios, dtype, device, out }) => {
            bench::head(&bench::Head { hidden, vocab, batch: &batch, ratios: &ratios, dtype: &dtype, device: &device, out: out.as_deref() })?
        }
        Command::Bench(BenchCommand::Draft { model, draft, draft_kind, freq, ratios, k, reps, json }) => {
            let d = bench::Drafting { target_spec: &model.model, kind: &draft_kind, draft: draft.as_deref(), freq: &freq, ratios: &ratios, k };
            bench::draft(|| model.load(), &d, reps, json)?
        }
        Command::Bench(BenchCommand::FastPath { model, draft, draft_kind, freq, ratios, dataset, num_prompts, k, max_new_tokens }) => {
            let d = bench::Drafting { target_spec: &model.model, kind: &draft_kind, draft: draft.as_deref(), freq: &freq, ratios: &ratios, k };
            bench::fast_path(|| model.load(), &d, &dataset, num_prompts, max_new_tokens)?
        }
        Command::Freq(FreqCommand::Build { tokenizer, corpus, format, out }) => freq::build(&tokenizer, &corpus, format, &out)?,
        Command::Freq(FreqCommand::FromOutputs { model, dataset, num_prompts, max_new_tokens, out }) => {
            freq::from_outputs(&model.load()?, &model.model, &dataset, num_prompts, max_new_tokens, &out)?
        }
        Command::Freq(FreqCommand::Show { file, ratios, vocab, on }) => {
            print!("{}", frspec::commands::freq::show(&file, &ratios, vocab, on.as_deref())?);
        }
    }
    Ok(())
}
