//! `frspec bench`: speed, side by side in one run, printed or as JSON. Decode on the CPU engine or on a device (the
//! candle engine: decode, verification and the speculative loop per ratio), the draft LM head against batch and kept
//! vocabulary, the draft step per ratio and head mode, and the T = 0 fast path against independent loops.

use crate::engine::candle;
use crate::loading::target::Target;
use crate::speculative::DraftKind;
use crate::text::chat::Message;
use crate::vocab::Frequencies;
use anyhow::{bail, Context, Result};
use std::path::Path;

pub struct Decode<'a> {
    pub model: &'a str,
    pub device: &'a str,
    pub prompt: &'a str,
    pub new_tokens: usize,
    pub runs: usize,
    pub block: usize,
    pub sequences: usize,
    /// A named shape with random weights (on the candle engine) instead of the model.
    pub shape: Option<&'a str>,
    pub dtype: &'a str,
    /// The candle engine on the CPU.
    pub candle: bool,
    pub prompt_tokens: usize,
    pub k: usize,
    pub ratios: &'a [f64],
    pub lengths: &'a [f64],
    pub batches: &'a [usize],
    pub compare_engine: bool,
    pub json: bool,
}

/// Decode speed; false when `compare_engine` found the device's greedy tokens differing from the CPU engine's.
pub fn decode(r: &Decode) -> Result<bool> {
    if r.runs == 0 || r.new_tokens == 0 || r.block == 0 || r.k == 0 || r.sequences == 0 {
        bail!("--runs, --new-tokens, --block, --sequences and --k must be at least 1");
    }
    if r.device == "cpu" && r.dtype == "f32" && r.shape.is_none() && !r.candle {
        let target = Target::load(r.model)?;
        let b = crate::bench::decode(&target, r.prompt, r.new_tokens, r.runs, r.block, r.sequences)?;
        if r.json {
            println!("{}", serde_json::to_string_pretty(&b)?);
        } else {
            println!("model {} ({} threads, median of {} runs)", target.source.display(), b.threads, b.runs);
            let types: Vec<String> = b.weight_types.iter().map(|(t, n)| format!("{n} {t}")).collect();
            println!("weights {} (activations: {})", types.join(", "), b.activations);
            let mib = |v: f64| v / (1u64 << 20) as f64;
            println!(
                "memory  {:.1} MiB of weights, peak resident {:.1} MiB, file {:.1} MiB ({:.2}× the file)",
                mib(b.weight_bytes as f64),
                mib(b.peak_rss_bytes as f64),
                mib(b.file_bytes as f64),
                b.peak_rss_bytes as f64 / b.file_bytes as f64
            );
            println!("decode  {:>8.1} tokens/s  ({} new tokens)", b.decode_tok_s, b.new_tokens);
            println!("prefill {:>8.1} tokens/s  ({} prompt tokens)", b.prefill_tok_s, b.prompt_tokens);
            println!("block of {} costs {:.2}× a one-token forward", b.block, b.block_cost_ratio);
            println!("decode  {:>8.1} tokens/s  ({} sequences together, {:.2}× one alone)", b.batched_decode_tok_s, b.sequences, b.batched_decode_tok_s / b.decode_tok_s);
            println!(
                "{} blocks of {}: {:.1} ms one by one, {:.1} ms together ({:.2}×)",
                b.sequences,
                b.block,
                1e3 * b.blocks_apart_secs,
                1e3 * b.blocks_together_secs,
                b.blocks_apart_secs / b.blocks_together_secs
            );
        }
        return Ok(true);
    }
    if r.lengths.iter().any(|l| !(*l >= 1.0)) {
        bail!("--lengths: every mean acceptance length is at least 1");
    }
    if r.batches.iter().any(|&b| b == 0 || b > crate::spec::MAX_BATCH) {
        bail!("--batches: every batch is 1 to {}", crate::spec::MAX_BATCH);
    }
    let device = candle::device(r.device)?;
    let dt = candle::dtype(r.dtype)?;
    let (llama, engine, tokens, weights) = match r.shape {
        Some(name) => {
            if r.compare_engine {
                bail!("--compare-engine needs --model (random weights exist on the device only)");
            }
            let shape = candle::llama::named_shape(name)?;
            let tokens = crate::bench::device::synthetic_prompt(r.prompt_tokens, shape.vocab);
            (candle::llama::Llama::random(&shape, &device, dt)?, None, tokens, "random".to_string())
        }
        None => {
            if r.compare_engine {
                // The candle engine multiplies exact activations; the CPU engine's tokens are its reference only so.
                crate::engine::cpu::tensor::Activations::set(crate::engine::cpu::tensor::Activations::F32)?;
            }
            let target = Target::load(r.model)?;
            let tokens = target.tokenizer.chat_prompt(&[Message::new("user", r.prompt)])?;
            let llama = candle::llama::Llama::from_engine(&target.model, &device, dt)?;
            (llama, r.compare_engine.then_some(target.model), tokens, target.source.display().to_string())
        }
    };
    if tokens.len() < 2 {
        bail!("the prompt must have at least 2 tokens (the draft pairs each with the next)");
    }
    let settings = crate::bench::device::DecodeSettings {
        device: r.device,
        prompt: &tokens,
        new_tokens: r.new_tokens,
        runs: r.runs,
        k: r.k,
        ratios: r.ratios,
        acceptance_lengths: r.lengths,
        batches: r.batches,
    };
    let b = crate::bench::device::decode(&llama, &weights, &settings, engine.as_ref())?;
    if r.json {
        println!("{}", serde_json::to_string_pretty(&b)?);
    } else {
        println!("{} on {} in {} ({} weights; median of {} runs)", crate::bench::device::describe(&llama.config), b.device, b.dtype, b.weights, b.runs);
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
        let limit_ms = 1e3 * b.step_limit_secs;
        println!("decode  {:>9.3} ms a token; the weight-streaming limit {limit_ms:.3} ms ({:.1} tokens/s)", 1e3 * b.decode_step_secs, 1.0 / b.step_limit_secs);
        println!("        {:>9.3} ms to enqueue a step on the host, {:.3} ms until the device has run it", 1e3 * b.decode_enqueue_secs, 1e3 * b.decode_synced_secs);
        println!("        {:>9.3} ms a step with candle's products for one-token attention", 1e3 * b.decode_products_synced_secs);
        for v in &b.verify {
            println!("verify  {:>9.3} ms for {:>3} tokens = {:.1}% of the limit", 1e3 * v.secs, v.tokens, 100.0 * v.share);
        }
        let header: String = r.lengths.iter().map(|l| format!("{:>11}", format!("tok/s@{l}"))).collect();
        println!("{:>6} {:>8} {:>10} {:>10} {:>7} {:>10} {:>11} {:>11} {header}", "ratio", "kept", "draft ms", "limit ms", "share", "step ms", "loop tok/s", "break-even");
        for d in &b.drafts {
            let projected: String = d.projected_tok_s.iter().map(|t| format!("{t:>11.1}")).collect();
            let (draft_ms, limit_ms, step_ms) = (1e3 * d.draft_step_secs, 1e3 * d.draft_limit_secs, 1e3 * d.speculative_step_secs);
            let share = format!("{:.1}%", 100.0 * d.draft_share);
            println!("{:>6} {:>8} {draft_ms:>10.3} {limit_ms:>10.3} {share:>7} {step_ms:>10.3} {:>11.1} {:>11.2} {projected}", d.ratio, d.kept, d.loop_tok_s, d.break_even_length);
        }
        let header: String = r.lengths.iter().map(|l| format!("{:>11}", format!("min@{l}"))).collect();
        println!("batched loop (ratio 0, k {}): minutes the llama31-eagle preset's sampled cells would take at this speed (at --shape llama31-8b; T = 1 is the estimate)", b.k);
        println!("{:>4} {:>6} {:>10} {:>11} {header}", "T", "batch", "steps/s", "tokens/s");
        for l in &b.batched {
            let minutes: String = l.preset_minutes.iter().map(|m| format!("{m:>11.1}")).collect();
            println!("{:>4} {:>6} {:>10.1} {:>11.1} {minutes}", l.temperature, l.batch, l.steps_per_sec, l.tok_s);
        }
        if let Some(a) = &b.agreement {
            match a.first_difference {
                None => println!("greedy tokens: {} of {} identical to the CPU engine's", a.device.len(), a.engine.len()),
                Some(i) => println!("greedy tokens: differ from the CPU engine's at position {i} of {}", a.engine.len()),
            }
        }
    }
    Ok(b.agreement.is_none_or(|a| a.first_difference.is_none()))
}

pub struct Head<'a> {
    pub hidden: usize,
    pub vocab: usize,
    pub batch: &'a [usize],
    pub ratios: &'a [f64],
    pub dtype: &'a str,
    pub device: &'a str,
    /// Where the table (Parquet) and the chart go.
    pub out: Option<&'a Path>,
}

/// Draft LM-head latency against batch and kept vocabulary, against the device's measured ceilings.
pub fn head(r: &Head) -> Result<()> {
    let (hidden, vocab, dtype, device) = (r.hidden, r.vocab, r.dtype, r.device);
    if hidden == 0 || vocab == 0 || r.batch.is_empty() || r.batch.contains(&0) {
        bail!("--hidden, --vocab and every --batch must be at least 1");
    }
    // `ran_on` ends the plot's title: where and through what the products ran.
    let (roof, points, ran_on) = if device == "cpu" {
        let block = if dtype.ends_with("_k") { 256 } else { 32 };
        if hidden % block != 0 {
            bail!("--hidden must be a multiple of {block} (the block size of {dtype} rows), got {hidden}");
        }
        let roof = crate::bench::roofline()?;
        let threads = crate::engine::cpu::tensor::pool().current_num_threads();
        (roof, crate::bench::head(hidden, vocab, r.batch, r.ratios, dtype, roof)?, format!("{threads} threads, frspec kernel"))
    } else {
        let (dev, dt) = (candle::device(device)?, candle::dtype(dtype)?);
        let roof = crate::bench::device::roofline(&dev, dt)?;
        (roof, crate::bench::device::head(hidden, vocab, r.batch, r.ratios, &dev, dt, roof)?, format!("{device}, as the engine runs it (rows padded to 128; one row through frspec's kernel)"))
    };
    println!("H = {hidden}, V = {vocab}, {dtype} weights on {device}; roofline there: {:.1} GB/s, {:.1} GFLOP/s", roof.bytes_per_sec / 1e9, roof.flops_per_sec / 1e9);
    let compared = points.iter().any(|p| p.matmul_exact_secs.is_some());
    let compared_header = if compared { format!(" {:>12}", "matmul ms") } else { String::new() };
    println!("{:>6} {:>8} {:>6} {:>12} {:>10} {:>10} {:>10} {:>9}{compared_header}", "ratio", "kept", "batch", "median ms", "GB/s", "GFLOP/s", "FLOP/B", "roofline");
    for p in &points {
        let compared = p.matmul_exact_secs.map_or(String::new(), |s| format!(" {:>12.4}", 1e3 * s));
        println!(
            "{:>6} {:>8} {:>6} {:>12.4} {:>10.2} {:>10.2} {:>10.2} {:>8.1}%{compared}",
            p.ratio,
            p.kept,
            p.batch,
            1e3 * p.median_secs,
            p.bytes_per_sec / 1e9,
            p.flops_per_sec / 1e9,
            p.intensity,
            100.0 * p.roofline_share
        );
    }
    if let Some(dir) = r.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        crate::outputs::store::write_head_bench(&dir.join("head.parquet"), &points)?;
        let title = format!("H = {hidden}, V = {vocab}, {dtype} weights, {ran_on}");
        crate::outputs::plot::head_latency(&dir.join("head_latency"), &points, &title)?;
    }
    Ok(())
}

/// A draft on the CPU engine and the frequencies that prune its head.
pub struct Drafting<'a> {
    /// What the target is loaded from (a truncated draft loads it again).
    pub target_spec: &'a str,
    pub kind: &'a DraftKind,
    pub draft: Option<&'a str>,
    pub freq: &'a str,
    pub ratios: &'a [f64],
    pub k: usize,
}

/// Head and draft-step time per ratio and head mode; `load` gives the target once the flags are checked.
pub fn draft(load: impl FnOnce() -> Result<Target>, d: &Drafting, reps: usize, json: bool) -> Result<()> {
    if d.k == 0 || reps == 0 {
        bail!("--k and --reps must be at least 1");
    }
    let (target, k) = (&load()?, d.k);
    let freqs = Frequencies::open(d.freq)?;
    let mut draft = crate::engine::cpu::draft::build(d.kind, d.draft, target, d.target_spec)?;
    let rows = crate::bench::draft_heads(target, draft.as_mut(), &freqs, d.ratios, k, reps, "What is the capital of France?")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let full = &rows[0];
    println!("draft: {} (k = {k}, median of {reps})", draft.describe());
    println!("{:>6} {:>6} {:>8} {:>7} {:>11} {:>12} {:>15} {:>12}", "ratio", "head", "kept", "kept %", "head ms", "head ÷ full", "draft step ms", "step ÷ full");
    for r in &rows {
        println!(
            "{:>6} {:>6} {:>8} {:>6.1}% {:>11.3} {:>12.3} {:>15.3} {:>12.3}",
            r.ratio,
            r.head,
            r.kept,
            100.0 * r.kept as f64 / target.model.config.vocab as f64,
            1e3 * r.head_secs,
            r.head_secs / full.head_secs,
            1e3 * r.draft_step_secs,
            r.draft_step_secs / full.draft_step_secs
        );
    }
    Ok(())
}

/// A T = 0 sweep over the ratios on the first `num_prompts` questions of `dataset`, as independent loops and
/// through the fast path; `load` gives the target once the flags are checked.
pub fn fast_path(load: impl FnOnce() -> Result<Target>, d: &Drafting, dataset: &str, num_prompts: usize, max_new_tokens: usize) -> Result<()> {
    if d.k == 0 || num_prompts == 0 || max_new_tokens == 0 {
        bail!("--k, --num-prompts and --max-new-tokens must be at least 1");
    }
    let target = &load()?;
    let freqs = Frequencies::open(d.freq)?;
    let questions = crate::text::dataset::load(dataset)?;
    let prompts = questions.iter().take(num_prompts).map(|q| target.tokenizer.chat_prompt(&[Message::new("user", &q.turns[0])])).collect::<Result<Vec<_>>>()?;
    let mut make = || crate::engine::cpu::draft::build(d.kind, d.draft, target, d.target_spec);
    let b = crate::bench::fast_path(target, &mut make, &freqs, d.ratios, &prompts, d.k, max_new_tokens)?;
    println!(
        "{} ratios × {} prompts, k = {}, T = 0: independent loops {:.1} s, fast path {:.1} s ({:.2}× faster); counts agree: {}",
        b.ratios.len(),
        b.prompts,
        d.k,
        b.independent_secs,
        b.fast_path_secs,
        b.independent_secs / b.fast_path_secs,
        b.counts_agree
    );
    Ok(())
}
