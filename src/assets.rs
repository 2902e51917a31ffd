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

/// A named asset: (name, path inside the cache, what it is).
const NAMED: &[(&str, &str, &str)] = &[
    ("smollm2", "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct GGUF (the default target)"),
    ("mt-bench", "mt_bench/question.jsonl", "MT-Bench questions"),
    ("llama31-tokenizer", "llama31-tokenizer", "Llama-3.1 tokenizer"),
    ("brown", "brown", "Brown corpus"),
];

/// The path of a named asset, or None when `name` is not one.
pub fn named(name: &str) -> Option<Result<PathBuf>> {
    let &(_, rel, what) = NAMED.iter().find(|(n, _, _)| *n == name)?;
    let path = cache_dir().join(rel);
    Some(if path.exists() {
        Ok(path)
    } else {
        let fetch = name.replace("mt-bench", "mtbench");
        Err(anyhow::anyhow!(
            "{what} is not at {} yet: run scripts/fetch-assets.sh {fetch} (or set FRSPEC_CACHE)",
            path.display()
        ))
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
    NAMED.iter().map(|(n, _, _)| *n)
}

/// Resolve a named asset or fail with the list of names.
pub fn require(name: &str) -> Result<PathBuf> {
    match named(name) {
        Some(r) => r,
        None => bail!("no asset named {name} (known: {})", names().collect::<Vec<_>>().join(", ")),
    }
}
