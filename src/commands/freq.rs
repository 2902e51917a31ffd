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
