//! `frspec freq build` and `freq from-outputs`: frequency files counted from a corpus with a tokenizer, or from the
//! tokens the target itself generates (vLLM's "target-dist").

use crate::loading::target::Target;
use crate::sampling::Sampling;
use crate::text::chat::Message;
use crate::vocab::{CorpusFormat, Frequencies};
use anyhow::{bail, Result};
use rand::SeedableRng;
use std::path::{Path, PathBuf};

/// Count the tokens of corpus files with `tokenizer` (a spec `load_tokenizer` understands) and write the file.
pub fn build(tokenizer: &str, corpus: &[PathBuf], format: CorpusFormat, out: &Path) -> Result<()> {
    let tok = crate::loading::target::load_tokenizer(tokenizer)?;
    let files = crate::vocab::corpus_files(corpus)?;
    let bar = indicatif::ProgressBar::new(files.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} files, {msg} tokens, {elapsed} (ETA {eta})")?,
    );
    let mut counts = vec![0u64; tok.vocab_size];
    for f in &files {
        let lines = crate::vocab::corpus_lines(f, format)?;
        let c = crate::vocab::count_tokens(&tok, &lines, tok.vocab_size)?;
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

/// A frequency file's metadata and, at each ratio, the share of its own counted tokens that the keep set holds, and
/// with `on` the share of that file's tokens. All or nothing: the text is returned whole or an error.
pub fn show(file: &str, ratios: &[f64], vocab: Option<usize>, on: Option<&str>) -> Result<String> {
    use std::fmt::Write;
    let f = Frequencies::open(file)?;
    let Some(vocab) = vocab.or_else(|| f.metadata.get("vocab").and_then(|v| v.parse().ok())) else {
        bail!("{file}: no vocabulary size in the file: pass --vocab");
    };
    let on = on.map(Frequencies::open).transpose()?;
    let mut meta: Vec<_> = f.metadata.iter().collect();
    meta.sort();
    let mut out = String::new();
    for (k, v) in meta {
        let _ = writeln!(out, "{k}: {v}");
    }
    let no_counts = |f: &Frequencies| anyhow::anyhow!("{} has no counts", f.source.display());
    let on_header = on.as_ref().map_or(String::new(), |o| format!(" {:>10}  (of {})", "on", o.source.display()));
    let _ = writeln!(out, "{:>7} {:>8} {:>10}{on_header}", "ratio", "kept", "coverage");
    for &r in ratios {
        let kept = crate::vocab::kept_for_ratio(r, vocab);
        let cov = f.coverage(kept).ok_or_else(|| no_counts(&f))?;
        let on_cov = match &on {
            Some(o) => format!(" {:>9.2}%", 100.0 * f.coverage_on(kept, o)?.ok_or_else(|| no_counts(o))?),
            None => String::new(),
        };
        let _ = writeln!(out, "{r:>7} {kept:>8} {:>9.2}%{on_cov}", 100.0 * cov);
    }
    Ok(out)
}

/// Count the greedy outputs of `target` (named `model` in the file) on the first turns of `dataset`'s questions.
pub fn from_outputs(target: &Target, model: &str, dataset: &str, num_prompts: Option<usize>, max_new_tokens: usize, out: &Path) -> Result<()> {
    let mut questions = crate::text::dataset::load(dataset)?;
    if let Some(n) = num_prompts {
        if n == 0 {
            bail!("--num-prompts must be at least 1");
        }
        questions.truncate(n);
    }
    let vocab = target.model.config.vocab;
    let mut counts = vec![0u64; vocab];
    let bar = indicatif::ProgressBar::new(questions.len() as u64);
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(0);
    for q in &questions {
        let prompt = target.tokenizer.chat_prompt(&[Message::new("user", &q.turns[0])])?;
        let g = crate::speculative::generate(&target.model, &target.tokenizer.stop_ids, &prompt, max_new_tokens, Sampling::GREEDY, &mut rng)?;
        g.tokens.iter().for_each(|&t| counts[t as usize] += 1);
        bar.inc(1);
    }
    bar.finish();
    let corpus = format!("greedy outputs of {model} on {dataset} ({} first turns, ≤ {max_new_tokens} tokens)", questions.len());
    let freq = Frequencies::counted(&counts, model, target.tokenizer.vocab_hash(), corpus, out);
    freq.save(out)?;
    eprintln!("{} generated tokens → {}", freq.metadata["tokens"], out.display());
    Ok(())
}
