//! Getting models and their files: GGUF / safetensors readers (`weights`), torch's pickles (`pickle`), the hub (`hub`), the offline
//! assets (`assets`), heads packed to ship (`pack`), and a named target resolved to a model with its tokenizer (`target`).

pub mod assets;
pub mod hub;
pub mod pack;
pub mod pickle;
pub mod target;
pub mod weights;

use anyhow::{bail, Result};
use std::path::{Component, Path};

/// A file name inside a repo or a model folder as an index file, a hub listing or a user gives it: relative and
/// made only of plain components (no `..`, no root, no drive), so that joined onto a cache or model folder it stays
/// inside it. Every name read from outside goes through here before it becomes a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoPath(String);

impl RepoPath {
    pub fn new(name: &str) -> Result<RepoPath> {
        let plain = !name.is_empty() && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)));
        if !plain || name.contains('\\') {
            bail!("file name {name:?} is not a plain relative path inside the repo or folder");
        }
        Ok(RepoPath(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}
