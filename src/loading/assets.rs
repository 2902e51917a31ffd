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
    ("sharegpt", "sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json", "ShareGPT V3 conversations", "scripts/fetch-assets.sh sharegpt"),
    ("brown-smollm2", "freq/brown-smollm2.safetensors", "Brown-corpus token frequencies for SmolLM2", "scripts/build-freq.sh"),
    (
        "brown-llama31-tokenizer",
        "freq/brown-llama31-tokenizer.safetensors",
        "Brown-corpus token frequencies for Llama-3.1",
        "scripts/build-freq.sh",
    ),
    (
        "sharegpt-smollm2",
        "freq/sharegpt-smollm2.safetensors",
        "ShareGPT-answer token frequencies for SmolLM2",
        "scripts/fetch-assets.sh sharegpt && scripts/build-freq.sh",
    ),
    (
        "sharegpt-llama31-tokenizer",
        "freq/sharegpt-llama31-tokenizer.safetensors",
        "ShareGPT-answer token frequencies for Llama-3.1",
        "scripts/fetch-assets.sh sharegpt && scripts/build-freq.sh",
    ),
];

/// What this repository made itself and ships inside the binary, so that any copy of frspec (an installed one, one
/// whose checkout is gone) finds it: (name, folder in the cache, files).
type Embedded = (&'static str, &'static str, &'static [(&'static str, &'static [u8])]);
const EMBEDDED: &[Embedded] = &[
    (
        "smollm2-eagle1",
        "heads/smollm2-135m-eagle1",
        &[
            ("config.json", include_bytes!("../../heads/smollm2-135m-eagle1/config.json")),
            ("model.safetensors", include_bytes!("../../heads/smollm2-135m-eagle1/model.safetensors")),
        ],
    ),
    // Packed (Q8_0, `loading::pack`): at f16 it would not fit what travels to a GPU machine beside the other.
    (
        "smollm2-eagle3",
        "heads/smollm2-135m-eagle3",
        &[
            ("config.json", include_bytes!("../../heads/smollm2-135m-eagle3/config.json")),
            ("model.gguf", include_bytes!("../../heads/smollm2-135m-eagle3/model.gguf")),
        ],
    ),
];

/// The folder holding an embedded asset's files, written into the cache on first use. Its name carries the files'
/// digest, so binaries that ship different versions never share a folder.
fn materialise(cache: &std::path::Path, rel: &str, files: &[(&str, &[u8])]) -> Result<PathBuf> {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for (name, bytes) in files {
        hash.update(name.as_bytes());
        hash.update(bytes);
    }
    let digest: String = hash.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect();
    let dir = cache.join(format!("{rel}-{digest}"));
    if files.iter().all(|(name, bytes)| std::fs::metadata(dir.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64)) {
        return Ok(dir);
    }
    // Written beside and renamed into place, so a reader never sees half a folder.
    let partial = dir.with_extension(format!("partial-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&partial)?;
        for (name, bytes) in files {
            std::fs::write(partial.join(name), bytes)?;
        }
        std::fs::rename(&partial, &dir)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_dir_all(&partial);
        // Another process may have put it there first.
        if !dir.is_dir() {
            bail!("cannot write {}: {e}", dir.display());
        }
    }
    Ok(dir)
}

/// The path of a named asset, or None when `name` is not one.
pub fn named(name: &str) -> Option<Result<PathBuf>> {
    if let Some(&(_, rel, files)) = EMBEDDED.iter().find(|(n, ..)| *n == name) {
        return Some(materialise(&cache_dir(), rel, files));
    }
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
    NAMED.iter().map(|(n, ..)| *n).chain(EMBEDDED.iter().map(|(n, ..)| *n))
}

/// Resolve a named asset or fail with the list of names.
pub fn require(name: &str) -> Result<PathBuf> {
    match named(name) {
        Some(r) => r,
        None => bail!("no asset named {name} (known: {})", names().collect::<Vec<_>>().join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_files_are_written_once_into_a_folder_named_by_their_digest() {
        let cache = tempfile::tempdir().unwrap();
        let files: &[(&str, &[u8])] = &[("config.json", b"{}"), ("model.safetensors", b"weights")];
        let dir = materialise(cache.path(), "heads/h", files).unwrap();
        assert!(dir.starts_with(cache.path().join("heads")) && dir.file_name().unwrap().to_str().unwrap().starts_with("h-"));
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), b"weights");
        assert_eq!(materialise(cache.path(), "heads/h", files).unwrap(), dir);
        let other = materialise(cache.path(), "heads/h", &[("config.json", b"{}"), ("model.safetensors", b"other weights")]).unwrap();
        assert_ne!(other, dir);
        assert_eq!(std::fs::read_dir(cache.path().join("heads")).unwrap().count(), 2, "no partial folder is left behind");
    }

    #[test]
    fn the_shipped_head_is_a_named_asset() {
        assert!(names().any(|n| n == crate::spec::SMOLLM2_HEAD));
    }
}
