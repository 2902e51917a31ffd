//! What a sweep is asked to do. Layers, later ones winning field by field: a preset, a sweep file (TOML, the same
//! keys as the flags in snake_case), vLLM's `--speculative-config` JSON, then the command-line flags.
//! `resolve` turns the merged layers into `Settings`, every field decided.

use crate::engine::cpu::tensor::Activations;
use crate::engine::EngineKind;
use crate::speculative::{DraftKind, DraftMode};
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One layer of a sweep's description; every field may be absent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// smollm2-eagle (the default when no --model is given) or llama31-eagle.
    #[arg(long)]
    pub preset: Option<String>,
    /// Target: a named offline asset (smollm2), a .gguf/.safetensors file, a model folder, or a hub repo id.
    #[arg(long)]
    pub model: Option<String>,
    /// Draft: an EAGLE-1/EAGLE-3 head folder or repo, or a draft model.
    #[arg(long)]
    pub draft: Option<String>,
    /// eagle | eagle3 | model | truncated:N.
    #[arg(long)]
    pub draft_kind: Option<String>,
    /// Token frequencies that rank the vocabulary (a frequency file, or a named one such as brown-smollm2).
    #[arg(long)]
    pub freq: Option<String>,
    /// Pruning ratios: the fraction of the vocabulary dropped from the draft head, each in [0, 1).
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set, conflicts_with = "keeps")]
    pub ratios: Option<Vec<f64>>,
    /// Keep sizes instead of ratios: the number of most frequent ids the draft head keeps.
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set)]
    pub keeps: Option<Vec<usize>>,
    /// Sampling temperatures; 0 is greedy.
    #[arg(long, value_delimiter = ',', action = clap::ArgAction::Set)]
    pub temperatures: Option<Vec<f32>>,
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Draft tokens per step.
    #[arg(long)]
    pub k: Option<usize>,
    /// Repeats of every sampled cell, each with its own random streams.
    #[arg(long)]
    pub repeats: Option<u32>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A named asset (mt-bench), a JSON-lines file (FastChat, H4 or Spec-Bench form) or a hub dataset
    /// (org/name[@rev][:file]).
    #[arg(long)]
    pub dataset: Option<String>,
    /// Use the first N questions (after the category filter).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Keep only questions of these categories.
    #[arg(long = "category", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub categories: Option<Vec<String>>,
    /// 1: first turns only; 2: both turns (turn 2 re-prefills the model's own first answer).
    #[arg(long)]
    pub turns: Option<usize>,
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// How the draft proposes: argmax (vLLM) or sample (full speculative sampling).
    #[arg(long, value_enum)]
    pub draft_mode: Option<DraftMode>,
    /// cpu, cuda or cuda:N (a build with --features cuda), or auto: the first GPU when one is usable, else the CPU.
    #[arg(long)]
    pub device: Option<String>,
    /// f32, f16 or bf16 (default: f32 on the CPU, bf16 on a GPU). The CPU engine computes in f32 only.
    #[arg(long)]
    pub dtype: Option<String>,
    /// cpu (frspec's bit-exact kernels; the default on the CPU) or candle (the default on a GPU).
    #[arg(long, value_enum)]
    pub engine: Option<EngineKind>,
    /// Sequences decoded together (default 16 on the CPU, 64 on a GPU). On the CPU engine the records do not depend
    /// on it; on the candle engine it is part of the settings `check` and `--resume` compare.
    #[arg(long)]
    pub batch: Option<usize>,
    /// CPU engine: which quantized rows multiply activations quantized to 8 bits, as llama.cpp does: q8 (the
    /// default; every quantized row, ≈ 1.5–2× faster than f32 activations with AVX2 or AVX-512 VNNI), kquants
    /// (K-quant rows only) or f32 (none: exact activations, what the candle engine computes). Default:
    /// FRSPEC_ACTIVATIONS, else q8. Records depend on it.
    #[arg(long, value_enum)]
    pub activations: Option<Activations>,
}

impl SweepSpec {
    /// `self` with every field `over` sets replaced.
    pub fn overlay(&self, over: &SweepSpec) -> SweepSpec {
        let (mut base, over) = (to_object(self), to_object(over));
        for (key, value) in over {
            if !value.is_null() {
                base.insert(key, value);
            }
        }
        serde_json::from_value(serde_json::Value::Object(base)).expect("fields of one struct")
    }

    /// A sweep file (TOML).
    pub fn from_toml_file(path: &Path) -> Result<SweepSpec> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read sweep file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow!("sweep file {}: {}", path.display(), e.message()))
    }

    /// vLLM's `--speculative-config` JSON. Keys that do not change what is measured (parallelism, lengths) are
    /// ignored and returned so the caller can say so.
    pub fn from_vllm(json: &str) -> Result<(SweepSpec, Vec<String>)> {
        let value: serde_json::Value = serde_json::from_str(json).map_err(|e| anyhow!("--speculative-config: not valid JSON: {e}"))?;
        let serde_json::Value::Object(fields) = value else {
            bail!("--speculative-config: expected a JSON object");
        };
        let field = |key: &str| fields.get(key).filter(|v| !v.is_null());
        let text = |key: &str| -> Result<Option<String>> {
            field(key).map(|v| v.as_str().map(String::from).ok_or_else(|| anyhow!("--speculative-config: `{key}` must be a string"))).transpose()
        };
        let mut spec = SweepSpec::default();
        if let Some(method) = text("method")? {
            spec.draft_kind = Some(
                match method.as_str() {
                    "eagle" => "eagle",
                    "eagle3" => "eagle3",
                    "draft_model" => "model",
                    other => bail!("--speculative-config: method `{other}` is not one frspec runs (eagle, eagle3, draft_model)"),
                }
                .into(),
            );
        }
        spec.draft = text("model")?;
        spec.freq = text("token_ids_by_frequency")?;
        if let Some(k) = field("num_speculative_tokens") {
            let k = k.as_u64().ok_or_else(|| anyhow!("--speculative-config: `num_speculative_tokens` must be a positive integer"))?;
            spec.k = Some(k as usize);
        }
        if let Some(r) = field("pruning_ratio") {
            let r = r.as_f64().ok_or_else(|| anyhow!("--speculative-config: `pruning_ratio` must be a number"))?;
            spec.ratios = Some(vec![r]);
        }
        const READ: [&str; 5] = ["method", "model", "token_ids_by_frequency", "num_speculative_tokens", "pruning_ratio"];
        let ignored = fields.keys().filter(|k| !READ.contains(&k.as_str())).cloned().collect();
        Ok((spec, ignored))
    }
}

fn to_object(spec: &SweepSpec) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(spec).expect("plain data") {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("a struct serializes to an object"),
    }
}

pub const PRESETS: [&str; 3] = ["smollm2-eagle", "smollm2-eagle3", "llama31-eagle"];

/// The EAGLE-1 head this repository ships for SmolLM2-135M-Instruct (heads/, scripts/train-smollm2-head.sh), an
/// asset compiled into the binary.
pub const SMOLLM2_HEAD: &str = "smollm2-eagle1";

/// The EAGLE-3 head shipped beside it (scripts/train-smollm2-head.sh eagle3), packed in Q8_0.
pub const SMOLLM2_EAGLE3_HEAD: &str = "smollm2-eagle3";

pub fn preset(name: &str) -> Result<SweepSpec> {
    let ratios = Some(vec![0.0, 0.25, 0.5, 0.75, 0.9, 0.99]);
    Ok(match name {
        // Everything offline: the assets of scripts/fetch-assets.sh and scripts/build-freq.sh, and the shipped head.
        // 20 prompts keep a CPU run near ten minutes. The keep sets rank ids by ShareGPT's answers, text of the kind
        // the target writes: ranked by Brown's prose, pruning cost twenty times as much at ratio 0.5 on MT-Bench, a
        // cost of the corpus rather than of pruning (results/freq/keep-sets.md).
        "smollm2-eagle" => SweepSpec {
            model: Some("smollm2".into()),
            draft: Some(SMOLLM2_HEAD.into()),
            draft_kind: Some("eagle".into()),
            freq: Some("sharegpt-smollm2".into()),
            dataset: Some("mt-bench".into()),
            num_prompts: Some(20),
            max_new_tokens: Some(128),
            ratios,
            ..SweepSpec::default()
        },
        // The same sweep through the EAGLE-3 head: its ratios prune its own draft vocabulary further, keeping the
        // draft ids that the keep set holds.
        "smollm2-eagle3" => SweepSpec { draft: Some(SMOLLM2_EAGLE3_HEAD.into()), draft_kind: Some("eagle3".into()), ..preset("smollm2-eagle")? },
        "llama31-eagle" => SweepSpec {
            model: Some("meta-llama/Llama-3.1-8B-Instruct".into()),
            draft: Some("yuhuili/EAGLE-LLaMA3.1-Instruct-8B".into()),
            draft_kind: Some("eagle".into()),
            freq: Some("sharegpt-llama31-tokenizer".into()),
            dataset: Some("philschmid/mt-bench".into()),
            max_new_tokens: Some(256),
            ratios,
            device: Some("auto".into()),
            ..SweepSpec::default()
        },
        other => bail!("unknown preset `{other}` (known: {})", PRESETS.join(", ")),
    })
}

/// How the draft head is pruned in each cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pruning {
    Ratios(Vec<f64>),
    Keeps(Vec<usize>),
}

/// A sweep with every setting decided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub preset: Option<String>,
    pub model: String,
    pub draft: Option<String>,
    #[serde(serialize_with = "as_display", deserialize_with = "from_display")]
    pub draft_kind: DraftKind,
    pub freq: Option<String>,
    pub pruning: Pruning,
    pub temperatures: Vec<f32>,
    pub top_p: f32,
    pub k: usize,
    pub repeats: u32,
    pub seed: u64,
    pub dataset: String,
    pub num_prompts: Option<usize>,
    pub categories: Vec<String>,
    pub turns: usize,
    pub max_new_tokens: usize,
    pub draft_mode: DraftMode,
    pub device: String,
    pub dtype: String,
    /// Left out of the settings' JSON for the CPU engine, so folders made before engines existed keep their identity.
    #[serde(skip_serializing_if = "EngineKind::is_cpu", default = "cpu_engine")]
    pub engine: EngineKind,
    /// Not in the settings' JSON: records depend on it only on the candle engine, whose sweeps add it
    /// (`identity_json`).
    #[serde(skip)]
    pub batch: usize,
    /// Left out of the settings' JSON when it is kquants, the mode of every folder made before the choice existed, so
    /// they keep their identity; the default (q8) is written.
    #[serde(skip_serializing_if = "Activations::is_unnamed", default = "Activations::unnamed")]
    pub activations: Activations,
    /// The part of the sweep this run makes (`--shard`); in the identity as `"shard": "I/N"` when set.
    #[serde(skip)]
    pub shard: Option<crate::sweep::shard::Shard>,
}

/// Sequences decoded together when the settings do not say: enough to fill a GPU; on a CPU enough that every ratio
/// of the default sweep has slots beside it (on 2 cores the main job ran 12% faster at 16 than at 8 and 4% slower
/// at 24 or 32).
fn default_batch(on_cpu: bool) -> usize {
    if on_cpu {
        16
    } else {
        64
    }
}

fn cpu_engine() -> EngineKind {
    EngineKind::Cpu
}

fn from_display<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<DraftKind, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(serde::de::Error::custom)
}

/// The most sequences one batch may hold: a slot holds a draft and a cache for the whole context.
pub const MAX_BATCH: usize = 1024;

impl Settings {
    /// The settings a sweep folder and `check` know a sweep by: the batch size counts where records depend on it.
    pub fn identity_json(&self) -> Result<serde_json::Value> {
        let mut json = serde_json::to_value(self)?;
        if !self.engine.is_cpu() {
            json["batch"] = self.batch.into();
        }
        if let Some(shard) = self.shard {
            json["shard"] = shard.to_string().into();
        }
        Ok(json)
    }

    /// The settings a sweep folder's identity records, read back (`frspec merge` rebuilds the sweep its shards ran).
    /// Reading back must give the same identity; otherwise another version of frspec wrote it.
    pub fn from_identity(json: &serde_json::Value) -> Result<Settings> {
        let mut settings: Settings =
            serde_json::from_value(json.clone()).map_err(|e| anyhow!("the recorded settings do not read back: {e}"))?;
        settings.batch = match json.get("batch") {
            Some(b) => b.as_u64().and_then(|b| usize::try_from(b).ok()).ok_or_else(|| anyhow!("the recorded batch {b} is not a count"))?,
            None => default_batch(settings.device == "cpu"),
        };
        settings.shard = match json.get("shard") {
            Some(serde_json::Value::String(s)) => Some(crate::sweep::shard::Shard::parse(s)?),
            Some(other) => bail!("the recorded shard {other} is not I/N"),
            None => None,
        };
        if settings.identity_json()? != *json {
            bail!("the recorded settings read back differently: the folder was made by another version of frspec");
        }
        Ok(settings)
    }
}

/// The first number a layer sets that is not finite: NaN and ±∞ are no ratio, temperature or top-p, and merging
/// layers (through JSON, which has no spelling for them) would turn them into a panic.
fn non_finite(layer: &SweepSpec) -> Option<(&'static str, f64)> {
    let ratios = layer.ratios.iter().flatten().map(|&r| ("ratios", r));
    let temperatures = layer.temperatures.iter().flatten().map(|&t| ("temperatures", t as f64));
    ratios.chain(temperatures).chain(layer.top_p.map(|p| ("top_p", p as f64))).find(|(_, v)| !v.is_finite())
}

fn as_display<S: serde::Serializer>(kind: &DraftKind, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(kind)
}

/// Merge the layers and fill what none of them sets. The default preset applies when neither a preset nor a
/// target is named.
pub fn resolve(file: Option<&SweepSpec>, vllm: Option<&SweepSpec>, flags: &SweepSpec) -> Result<Settings> {
    for (layer, source) in [(file, "sweep file"), (vllm, "--speculative-config"), (Some(flags), "flags")] {
        if let Some((field, value)) = layer.and_then(non_finite) {
            bail!("{source}: {field} {value} is not a finite number");
        }
    }
    let mut merged = SweepSpec::default();
    for layer in [file, vllm, Some(flags)].into_iter().flatten() {
        merged = merged.overlay(layer);
    }
    let preset_name = match (&merged.preset, &merged.model) {
        (Some(p), _) => Some(p.clone()),
        (None, None) => Some(PRESETS[0].to_string()),
        (None, Some(_)) => None,
    };
    let s = match &preset_name {
        Some(p) => preset(p)?.overlay(&merged),
        None => merged,
    };
    let draft_kind = match (&s.draft_kind, &s.draft) {
        (Some(k), _) => k.parse::<DraftKind>().map_err(|e| anyhow!("draft_kind: {e}"))?,
        (None, Some(_)) => DraftKind::Eagle,
        (None, None) => bail!("no draft: name one with --draft / --draft-kind, or use a --preset"),
    };
    let pruning = match (s.ratios, s.keeps) {
        (Some(_), Some(_)) => bail!("ratios and keeps are both set: a sweep prunes by one of them"),
        (None, Some(k)) => Pruning::Keeps(k),
        (Some(r), None) => Pruning::Ratios(r),
        (None, None) => Pruning::Ratios(vec![0.0, 0.25, 0.5, 0.75, 0.9, 0.99]),
    };
    let device = match s.device.as_deref() {
        None => "cpu".to_string(),
        Some("auto") if crate::engine::candle::gpu_present() => "cuda".to_string(),
        Some("auto") => "cpu".to_string(),
        Some(d) => d.to_string(),
    };
    let on_cpu = device == "cpu";
    Ok(Settings {
        preset: preset_name,
        model: s.model.unwrap_or_else(|| crate::loading::target::DEFAULT_MODEL.into()),
        draft: s.draft,
        draft_kind,
        freq: s.freq,
        pruning,
        temperatures: s.temperatures.unwrap_or_else(|| vec![0.0, 1.0]),
        top_p: s.top_p.unwrap_or(1.0),
        k: s.k.unwrap_or(4),
        repeats: s.repeats.unwrap_or(3),
        seed: s.seed.unwrap_or(0),
        dataset: s.dataset.unwrap_or_else(|| "philschmid/mt-bench".into()),
        num_prompts: s.num_prompts,
        categories: s.categories.unwrap_or_default(),
        turns: s.turns.unwrap_or(1),
        max_new_tokens: s.max_new_tokens.unwrap_or(128),
        draft_mode: s.draft_mode.unwrap_or(DraftMode::Argmax),
        dtype: s.dtype.unwrap_or_else(|| if on_cpu { "f32" } else { "bf16" }.into()),
        engine: s.engine.unwrap_or(if on_cpu { EngineKind::Cpu } else { EngineKind::Candle }),
        batch: match s.batch.unwrap_or(default_batch(on_cpu)) {
            b @ 1..=MAX_BATCH => b,
            b => bail!("batch is {b}: a sweep decodes 1 to {MAX_BATCH} sequences together"),
        },
        activations: match s.activations {
            Some(a) => a,
            None => Activations::from_env_checked()?,
        },
        device,
        shard: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_layers_win_field_by_field_and_the_default_preset_fills_the_rest() {
        let file = SweepSpec { repeats: Some(5), k: Some(3), ..SweepSpec::default() };
        let flags = SweepSpec { k: Some(2), ratios: Some(vec![0.0, 0.5]), ..SweepSpec::default() };
        let s = resolve(Some(&file), None, &flags).unwrap();
        assert_eq!((s.repeats, s.k, s.pruning.clone()), (5, 2, Pruning::Ratios(vec![0.0, 0.5])));
        assert_eq!((s.preset.as_deref(), s.model.as_str(), s.dataset.as_str()), (Some("smollm2-eagle"), "smollm2", "mt-bench"));
        assert_eq!((s.draft_kind, s.draft.as_deref()), (DraftKind::Eagle, Some(SMOLLM2_HEAD)));
    }

    #[test]
    fn the_eagle3_preset_is_the_default_one_through_the_eagle3_head() {
        let s = resolve(None, None, &SweepSpec { preset: Some("smollm2-eagle3".into()), ..SweepSpec::default() }).unwrap();
        let default = resolve(None, None, &SweepSpec::default()).unwrap();
        assert_eq!((s.draft_kind, s.draft.as_deref()), (DraftKind::Eagle3, Some(SMOLLM2_EAGLE3_HEAD)));
        let same = Settings { preset: default.preset.clone(), draft_kind: default.draft_kind.clone(), draft: default.draft.clone(), ..s };
        assert_eq!(same, default);
    }

    #[test]
    fn the_activations_are_in_the_identity_unless_they_are_those_of_folders_that_never_named_them() {
        let default = resolve(None, None, &SweepSpec::default()).unwrap();
        assert_eq!(default.activations, Activations::Q8);
        let json = default.identity_json().unwrap();
        assert_eq!(json["activations"], "q8");
        assert_eq!(Settings::from_identity(&json).unwrap(), default);
        let kquants = resolve(None, None, &SweepSpec { activations: Some(Activations::KQuants), ..SweepSpec::default() }).unwrap();
        let json = kquants.identity_json().unwrap();
        assert!(json.get("activations").is_none());
        assert_eq!(Settings::from_identity(&json).unwrap(), kquants);
    }

    #[test]
    fn a_named_model_without_a_preset_needs_a_draft() {
        let flags = SweepSpec { model: Some("org/model".into()), ..SweepSpec::default() };
        let err = resolve(None, None, &flags).unwrap_err().to_string();
        assert!(err.contains("no draft"), "{err}");
        let flags = SweepSpec { draft: Some("org/head".into()), ..flags };
        let s = resolve(None, None, &flags).unwrap();
        assert_eq!((s.preset, s.draft_kind, s.dataset.as_str()), (None, DraftKind::Eagle, "philschmid/mt-bench"));
    }

    #[test]
    fn vllm_speculative_config_maps_onto_the_spec() {
        let json = r#"{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4,
                       "token_ids_by_frequency": "freq.pt", "pruning_ratio": 0.75, "draft_tensor_parallel_size": 1}"#;
        let (spec, ignored) = SweepSpec::from_vllm(json).unwrap();
        assert_eq!(spec.draft.as_deref(), Some("yuhuili/EAGLE-LLaMA3.1-Instruct-8B"));
        assert_eq!((spec.k, spec.ratios.clone(), spec.freq.as_deref()), (Some(4), Some(vec![0.75]), Some("freq.pt")));
        assert_eq!(ignored, ["draft_tensor_parallel_size"]);
        let err = SweepSpec::from_vllm(r#"{"method": "ngram"}"#).unwrap_err().to_string();
        assert!(err.contains("method `ngram`"), "{err}");
        assert!(SweepSpec::from_vllm("[1]").unwrap_err().to_string().contains("JSON object"));
    }

    #[test]
    fn every_sweep_file_in_the_repository_resolves() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let file = SweepSpec::from_toml_file(&path).unwrap_or_else(|e| panic!("{e:#}"));
            resolve(Some(&file), None, &SweepSpec::default()).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            seen += 1;
        }
        assert!(seen >= 2, "sweeps/ holds the presets' sweep files");
    }

    #[test]
    fn unknown_presets_and_both_ratios_and_keeps_are_refused() {
        let err = resolve(None, None, &SweepSpec { preset: Some("gpt5".into()), ..SweepSpec::default() }).unwrap_err().to_string();
        assert!(err.contains("unknown preset `gpt5`"), "{err}");
        let file = SweepSpec { keeps: Some(vec![100]), ..SweepSpec::default() };
        let flags = SweepSpec { ratios: Some(vec![0.5]), ..SweepSpec::default() };
        assert!(resolve(Some(&file), None, &flags).unwrap_err().to_string().contains("both set"));
    }
}
