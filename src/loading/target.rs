//! A target model with its tokenizer, resolved from a name: a named offline asset (`smollm2`), a local
//! `.gguf` / `.safetensors` file or model folder, or a hub repo id (`org/name[@revision]`).

use crate::loading::assets;
use crate::loading::hub::{Hub, RepoId, RepoKind};
use crate::engine::cpu::model::Model;
use crate::text::tokenizer::Tokenizer;
use crate::loading::weights::Gguf;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The model the CLI uses when none is named.
pub const DEFAULT_MODEL: &str = "smollm2";

pub struct Target {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Where the weights came from (for reports).
    pub source: PathBuf,
}

impl Target {
    pub fn load(spec: &str) -> Result<Target> {
        let path = resolve(spec)?;
        let model = Model::load(&path)?;
        let tokenizer = tokenizer_at(&path)?;
        if tokenizer.vocab_size > model.config.vocab {
            bail!(
                "{}: the tokenizer has {} tokens but the model only {} embedding rows",
                path.display(),
                tokenizer.vocab_size,
                model.config.vocab
            );
        }
        Ok(Target { model, tokenizer, source: path })
    }
}

/// A tokenizer on its own: a named asset, a `.gguf`, a `tokenizer.json` or its folder, or a model spec that
/// `resolve` understands (hub repo ids included).
pub fn load_tokenizer(spec: &str) -> Result<Tokenizer> {
    tokenizer_at(&resolve(spec)?)
}

/// The tokenizer stored with the weights at `path`: inside a `.gguf`, or beside them (tokenizer.json).
fn tokenizer_at(path: &Path) -> Result<Tokenizer> {
    if path.extension().is_some_and(|e| e == "gguf") {
        return Tokenizer::from_gguf(&Gguf::open(path)?);
    }
    let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
    Tokenizer::from_hf_dir(dir)
}

/// The local file or folder holding the model named by `spec`; hub repos are downloaded first.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    if let Some(found) = assets::local(spec) {
        return found;
    }
    let Some(repo) = RepoId::parse(spec) else {
        bail!("model {spec}: no such file or folder, and not a hub repo id (org/name[@revision])");
    };
    let hub = Hub::from_env();
    // A tokenizer-only repo has no config.json: its folder is the tokenizer.
    let Some(config) = hub.optional_file(RepoKind::Model, &repo, "config.json")? else {
        let tokenizer = hub.file(RepoKind::Model, &repo, "tokenizer.json")?;
        hub.optional_file(RepoKind::Model, &repo, "tokenizer_config.json")?;
        return Ok(tokenizer.parent().expect("a cached file lives in a snapshot folder").to_path_buf());
    };
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        hub.optional_file(RepoKind::Model, &repo, file)?;
    }
    if let Some(index) = hub.optional_file(RepoKind::Model, &repo, "model.safetensors.index.json")? {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", index.display()))?;
        let mut shards: Vec<&str> = json["weight_map"].as_object().into_iter().flatten().filter_map(|(_, v)| v.as_str()).collect();
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            hub.file(RepoKind::Model, &repo, shard)?;
        }
    } else if hub.optional_file(RepoKind::Model, &repo, "model.safetensors")?.is_none()
        // EAGLE heads (yuhuili's among them) ship a PyTorch pickle.
        && hub.optional_file(RepoKind::Model, &repo, "pytorch_model.bin")?.is_none()
    {
        bail!("model repo {spec} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin");
    }
    Ok(config.parent().expect("a cached file lives in a snapshot folder").to_path_buf())
}
