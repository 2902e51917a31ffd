//! The small real assets frspec runs on offline, fetched by scripts/fetch-assets.sh into one cache folder.

use anyhow::{bail, Result};
use std::path::PathBuf;

/// `$FRSPEC_CACHE`, or `~/.cache/frspec`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FRSPEC_CACHE") {
        return dir.into();
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("frspec")
}

/// A named asset: (name, path inside the cache, what it is, the command that makes it).
const NAMED: &[(&str, &str, &str, &str)] = &[
    ("smollm2", "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct GGUF (the default target)", "scripts/fetch-assets.sh smollm2"),
    ("mt-bench", "mt_bench/question.jsonl", "MT-Bench questions", "scripts/fetch-assets.sh mtbench"),
    ("llama31-tokenizer", "llama31-tokenizer", "Llama-3.1 tokenizer", "scripts/fetch-assets.sh llama31-tokenizer"),
    ("brown", "brown", "Brown corpus", "scripts/fetch-assets.sh brown"),
    ("brown-smollm2", "freq/brown-smollm2.safetensors", "Brown-corpus token frequencies for SmolLM2", "scripts/build-freq.sh"),
    (
        "brown-llama31-tokenizer",
        "freq/brown-llama31-tokenizer.safetensors",
        "Brown-corpus token frequencies for Llama-3.1",
        "scripts/build-freq.sh",
    ),
];

/// The path of a named asset, or None when `name` is not one.
pub fn named(name: &str) -> Option<Result<PathBuf>> {
    let &(_, rel, what, make) = NAMED.iter().find(|(n, ..)| *n == name)?;
    let path = cache_dir().join(rel);
    Some(if path.exists() {
        Ok(path)
    } else {
        Err(anyhow::anyhow!("{what} is not at {} yet: run {make} (or set FRSPEC_CACHE)", path.display()))
    })
}

/// A named asset or an existing local path; None when `spec` is neither (it may be a hub id).
pub fn local(spec: &str) -> Option<Result<PathBuf>> {
    named(spec).or_else(|| {
        let path = std::path::Path::new(spec);
        path.exists().then(|| Ok(path.to_path_buf()))
    })
}

pub fn names() -> impl Iterator<Item = &'static str> {
    NAMED.iter().map(|(n, ..)| *n)
}

/// Resolve a named asset or fail with the list of names.
pub fn require(name: &str) -> Result<PathBuf> {
    match named(name) {
        Some(r) => r,
        None => bail!("no asset named {name} (known: {})", names().collect::<Vec<_>>().join(", ")),
    }
}
