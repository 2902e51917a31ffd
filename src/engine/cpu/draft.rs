//! The drafts on the CPU engine: an independent (or truncated-target) draft model, EAGLE-1 and EAGLE-3 heads, each
//! proposing through a `DraftHead` that FR-Spec may prune to a keep set.

use super::model::{load_layer, load_linear, Cache, Geometry, Layer, Linear, Model};
use super::tensor::Matrix;
use super::CpuFeatures;
use crate::speculative::{Chooser, Context, Draft, DraftKind, LmHead};
use crate::loading::weights::WeightSource;
use anyhow::{anyhow, bail, Context as _, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A draft model sharing the target's tokenizer: an independent model or a truncated copy of the target.
pub struct ModelDraft {
    pub(crate) model: Arc<Model>,
    cache: Cache,
    chooser: Chooser<Arc<Matrix>>,
    pub(crate) label: String,
}

impl ModelDraft {
    pub fn new(model: Model, label: String) -> ModelDraft {
        let cache = model.new_cache();
        ModelDraft { model: Arc::new(model), cache, chooser: Chooser::default(), label }
    }

    /// Another draft on the same weights with an empty cache (a slot of a batch).
    fn fresh(&self) -> ModelDraft {
        ModelDraft { model: self.model.clone(), cache: self.model.new_cache(), chooser: Chooser::default(), label: self.label.clone() }
    }
}

impl Draft<Model> for ModelDraft {
    fn describe(&self) -> String {
        self.label.clone()
    }

    fn lm_head(&self) -> LmHead<Arc<Matrix>> {
        LmHead::full(self.model.lm_head_shared())
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        // Every token the draft has not seen, the last one (not yet verified) included.
        let fwd = self.model.forward(&ctx.tokens[self.cache.len()..], &mut self.cache, &[], &[])?;
        Ok(fwd.hidden[fwd.hidden.len() - self.model.config.hidden..].to_vec())
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(self.model.forward(&[token], &mut self.cache, &[], &[])?.hidden)
    }

    fn chooser(&mut self) -> &mut Chooser<Arc<Matrix>> {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, accepted: usize) -> Result<()> {
        // Accepted proposals are real tokens: keep their positions.
        self.cache.truncate(self.cache.len().min(before + accepted));
        Ok(())
    }
}

/// EAGLE-1 (SafeAILab `cnets1.py`): h = fc(cat(embed(t_{i+1}), f_i)), one decoder layer without input norm,
/// no final norm, logits through the target's LM head. Reuses the target's embedding.
pub struct EagleDraft<'a> {
    target: &'a Model,
    pub(crate) fc: Arc<Linear>,
    pub(crate) layer: Arc<Layer>,
    pub(crate) geometry: Geometry,
    cache: Cache,
    chooser: Chooser<Arc<Matrix>>,
    input: Vec<f32>,
    pair: Vec<f32>,
    /// The layer's output at the last drafted position: the stand-in feature for the next one.
    last: Vec<f32>,
    pub(crate) source: PathBuf,
}

/// Named tensors of a checkpoint (safetensors, PyTorch pickle, or the GGUF of `loading::pack`), answering to
/// GGUF-style layer names.
struct TensorFile {
    path: PathBuf,
    store: Store,
    /// What the checkpoint calls its decoder layer: `layers.0.` (EAGLE-1) or `midlayer.` (EAGLE-3).
    layer_prefix: &'static str,
}

/// A checkpoint's tensors by their own (HF) names: read whole into candle tensors, or a GGUF whose matrices stay
/// quantized.
enum Store {
    Tensors(HashMap<String, Tensor>),
    Gguf(crate::loading::weights::Gguf),
}

impl TensorFile {
    fn open(path: &Path) -> Result<TensorFile> {
        let extension = path.extension().and_then(|e| e.to_str());
        let store = match extension {
            Some("safetensors") => Store::Tensors(
                candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?,
            ),
            Some("gguf") => Store::Gguf(crate::loading::weights::Gguf::open(path)?),
            _ => Store::Tensors(crate::loading::pickle::TorchFile::open(path)?.state_dict()?),
        };
        Ok(TensorFile { path: path.to_path_buf(), store, layer_prefix: "layers.0." })
    }

    /// EAGLE checkpoints name layers as HF does, without the `model.` prefix.
    fn key(&self, name: &str) -> String {
        let hf = crate::loading::weights::hf_name(name);
        let hf = hf.strip_prefix("model.").map(String::from).unwrap_or(hf);
        match hf.strip_prefix("layers.0.") {
            Some(rest) => format!("{}{rest}", self.layer_prefix),
            None => hf,
        }
    }

    fn lookup<'t>(&self, tensors: &'t HashMap<String, Tensor>, key: &str) -> Result<&'t Tensor> {
        tensors.get(key).ok_or_else(|| anyhow!("{}: tensor {key} is missing", self.path.display()))
    }

    /// A weight: `lookup`, and float.
    fn tensor<'t>(&self, tensors: &'t HashMap<String, Tensor>, key: &str) -> Result<&'t Tensor> {
        let t = self.lookup(tensors, key)?;
        crate::loading::weights::float_weights(t, &self.path, key)?;
        Ok(t)
    }

    /// Tensor `key` (its own name) flattened to f32.
    fn raw_values(&self, key: &str) -> Result<Vec<f32>> {
        match &self.store {
            Store::Tensors(tensors) => Ok(self.tensor(tensors, key)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            Store::Gguf(gguf) => gguf.vector(key),
        }
    }

    fn raw_vector(&self, key: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.raw_values(key)?;
        if v.len() != len {
            bail!("{}: {key} has {} values, expected {len}", self.path.display(), v.len());
        }
        Ok(v)
    }

    /// EAGLE-3's `d2t`: i64 in safetensors; f32 in a packed GGUF, which has no integer tensors (exact below 2^24).
    fn offsets(&self, key: &str) -> Result<Vec<i64>> {
        match &self.store {
            Store::Tensors(tensors) => Ok(self.lookup(tensors, key)?.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?),
            Store::Gguf(gguf) => gguf
                .vector(key)?
                .iter()
                .map(|&v| match v.fract() == 0.0 && v.abs() < (1 << 24) as f32 {
                    true => Ok(v as i64),
                    false => Err(anyhow!("{}: {key} holds {v}, not an id offset", self.path.display())),
                })
                .collect(),
        }
    }
}

impl WeightSource for TensorFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        let key = self.key(name);
        match &self.store {
            Store::Tensors(tensors) => tensors.contains_key(&key),
            Store::Gguf(gguf) => gguf.contains(&key),
        }
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let key = self.key(name);
        let tensors = match &self.store {
            Store::Tensors(tensors) => tensors,
            Store::Gguf(gguf) => return gguf.matrix(&key),
        };
        crate::loading::weights::matrix_of(self.tensor(tensors, &key)?, &self.path, &key)
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        self.raw_values(&self.key(name))
    }
}

impl<'a> EagleDraft<'a> {
    /// `dir` holds config.json and model.safetensors or pytorch_model.bin, with yuhuili's key names.
    pub fn load(dir: &Path, target: &'a Model) -> Result<EagleDraft<'a>> {
        let config_path = dir.join("config.json");
        let mut config = super::model::hf_config(&config_path)?;
        let t = &target.config;
        if config.hidden != t.hidden {
            bail!("{}: EAGLE hidden size {} ≠ the target's {}", config_path.display(), config.hidden, t.hidden);
        }
        if config.vocab != t.vocab {
            bail!("{}: EAGLE vocabulary {} ≠ the target's {}", config_path.display(), config.vocab, t.vocab);
        }
        config.layers = 1;
        let src = TensorFile::open(&checkpoint(dir)?).with_context(|| format!("loading EAGLE head {}", dir.display()))?;
        let fc = load_linear(&src, "fc", config.hidden, 2 * config.hidden)?;
        let layer = load_layer(&src, &config, "blk.0", false)?;
        let geometry = Geometry::new(&config, None);
        let cache = Cache::new(1, &geometry);
        Ok(EagleDraft {
            target,
            fc: Arc::new(fc),
            layer: Arc::new(layer),
            geometry,
            cache,
            chooser: Chooser::default(),
            input: Vec::new(),
            pair: Vec::new(),
            last: Vec::new(),
            source: dir.to_path_buf(),
        })
    }

    /// The layer outputs of every draft position the cache has not seen. Draft position j pairs (f_j, t_{j+1});
    /// every j < n − 1 has a true target feature.
    fn unseen_positions(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        let (h, n, seen) = (self.geometry.hidden, ctx.tokens.len(), self.cache.len());
        self.step(&ctx.features.hidden[seen * h..(n - 1) * h], &ctx.tokens[seen + 1..n])
    }

    /// Run pairs (feature row, next token) through fc and the layer; returns the layer outputs `[n, hidden]`.
    fn step(&mut self, features: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.geometry.hidden;
        self.target.embed_into(tokens, &mut self.input)?;
        self.pair.clear();
        for (e, f) in self.input.chunks_exact(h).zip(features.chunks_exact(h)) {
            self.pair.extend_from_slice(e);
            self.pair.extend_from_slice(f);
        }
        let mut x = vec![0.0; tokens.len() * h];
        self.fc.forward(&self.pair, &mut x, self.cache.matmul_scratch());
        self.cache.advance(&self.geometry, std::slice::from_ref(&*self.layer), &mut x, None, |_, _| {});
        Ok(x)
    }

    /// Another draft on the same weights with an empty cache (a slot of a batch).
    fn fresh(&self) -> EagleDraft<'a> {
        EagleDraft {
            target: self.target,
            fc: self.fc.clone(),
            layer: self.layer.clone(),
            geometry: self.geometry.clone(),
            cache: Cache::new(1, &self.geometry),
            chooser: Chooser::default(),
            input: Vec::new(),
            pair: Vec::new(),
            last: Vec::new(),
            source: self.source.clone(),
        }
    }
}

impl EagleDraft<'_> {
    /// Teacher-forced draft logits (full head) at every draft position of `ctx`, from an empty cache:
    /// `[tokens.len() - 1, vocab]`. For numerics checks against other implementations.
    pub fn teacher_forced_logits(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        self.reset();
        let out = self.unseen_positions(ctx)?;
        let n = ctx.tokens.len();
        let head = self.target.lm_head();
        let mut logits = vec![0.0; (n - 1) * head.rows];
        head.matmul(&out, &mut logits, self.cache.matmul_scratch());
        Ok(logits)
    }
}

impl Draft<Model> for EagleDraft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-1 head {}", self.source.display())
    }

    fn lm_head(&self) -> LmHead<Arc<Matrix>> {
        LmHead::full(self.target.lm_head_shared())
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        let g = self.unseen_positions(ctx)?;
        self.last = g[g.len() - self.geometry.hidden..].to_vec();
        Ok(self.last.clone())
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        // No target feature exists yet for the drafted position: EAGLE feeds its own output instead.
        let last = std::mem::take(&mut self.last);
        self.last = self.step(&last, &[token])?;
        Ok(self.last.clone())
    }

    fn chooser(&mut self) -> &mut Chooser<Arc<Matrix>> {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        self.cache.truncate(before - 1);
        Ok(())
    }
}

/// The weights file of an EAGLE head folder.
fn checkpoint(dir: &Path) -> Result<PathBuf> {
    ["model.safetensors", "pytorch_model.bin", crate::loading::pack::PACKED]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!("{}: no model.safetensors, pytorch_model.bin or {}", dir.display(), crate::loading::pack::PACKED))
}

/// The target layers whose incoming residual streams an EAGLE-3 head reads when its config names none: low,
/// middle and high (EAGLE-3's and vLLM's choice).
pub fn eagle3_default_layers(layers: usize) -> Vec<usize> {
    vec![2, layers / 2, layers.saturating_sub(3)]
}

/// The target ids of an EAGLE-3 head's draft vocabulary: draft id d is target id d + d2t[d], each within the
/// target's `vocab` (`path` names the head's file in the error).
pub fn d2t_target_ids(d2t: &[i64], vocab: usize, path: &Path) -> Result<Vec<u32>> {
    d2t.iter()
        .enumerate()
        .map(|(d, off)| match u32::try_from(d as i64 + off) {
            Ok(id) if (id as usize) < vocab => Ok(id),
            _ => Err(anyhow!("{}: d2t maps draft id {d} outside the target vocabulary", path.display())),
        })
        .collect()
}

/// EAGLE-3 (SafeAILab `cnets.py`, vLLM `llama_eagle3.py`): g = fc(cat of the target's residual streams entering
/// three layers); one `midlayer` attending over cat(input_layernorm(embed(t)), hidden_norm(g)) with g as the
/// residual; its own final `norm` and `lm_head` over a draft vocabulary whose row d is target id d + d2t[d].
/// Later drafting steps feed the layer's own pre-norm output in place of g.
pub struct Eagle3Draft<'a> {
    target: &'a Model,
    pub(crate) fc: Arc<Linear>,
    pub(crate) layer: Arc<Layer>,
    pub(crate) input_norm: Vec<f32>,
    pub(crate) hidden_norm: Vec<f32>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: LmHead<Arc<Matrix>>,
    pub(crate) aux_layers: Vec<usize>,
    pub(crate) geometry: Geometry,
    cache: Cache,
    chooser: Chooser<Arc<Matrix>>,
    embeds: Vec<f32>,
    attn_input: Vec<f32>,
    /// The midlayer's pre-norm output at the last drafted position: the next position's input in place of g.
    last: Vec<f32>,
    pub(crate) source: PathBuf,
}

impl<'a> Eagle3Draft<'a> {
    /// `dir` holds config.json (with `draft_vocab_size`) and the checkpoint with yuhuili's EAGLE-3 key names.
    pub fn load(dir: &Path, target: &'a Model) -> Result<Eagle3Draft<'a>> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", config_path.display()))?;
        // The checkpoint's architecture name is EAGLE-specific; the layer itself is a Llama layer.
        let mut config = super::model::hf_config_from(raw.clone(), &config_path, true)?;
        let t = &target.config;
        if config.hidden != t.hidden {
            bail!("{}: EAGLE-3 hidden size {} ≠ the target's {}", config_path.display(), config.hidden, t.hidden);
        }
        if config.vocab != t.vocab {
            bail!("{}: EAGLE-3 vocabulary {} ≠ the target's {}", config_path.display(), config.vocab, t.vocab);
        }
        config.layers = 1;
        let draft_vocab = raw["draft_vocab_size"].as_u64().map_or(config.vocab, |v| v as usize);
        let aux_layers: Vec<usize> = match raw.pointer("/eagle_config/eagle_aux_hidden_state_layer_ids").and_then(|v| v.as_array()) {
            Some(ids) => ids.iter().filter_map(|v| v.as_u64()).map(|v| v as usize).collect(),
            None => eagle3_default_layers(t.layers),
        };
        if aux_layers.len() != 3 || aux_layers.iter().any(|&l| l >= t.layers) || t.layers < 4 {
            bail!("{}: auxiliary layers {aux_layers:?} do not fit a target of {} layers", config_path.display(), t.layers);
        }
        let mut src = TensorFile::open(&checkpoint(dir)?).with_context(|| format!("loading EAGLE-3 head {}", dir.display()))?;
        src.layer_prefix = "midlayer.";
        let h = config.hidden;
        let (qd, kvd) = (config.heads * config.head_dim, config.kv_heads * config.head_dim);
        let layer = Layer {
            attn_norm: None,
            q: load_linear(&src, "blk.0.attn_q", qd, 2 * h)?,
            k: load_linear(&src, "blk.0.attn_k", kvd, 2 * h)?,
            v: load_linear(&src, "blk.0.attn_v", kvd, 2 * h)?,
            o: load_linear(&src, "blk.0.attn_output", h, qd)?,
            ffn_norm: super::model::load_norm(&src, "blk.0.ffn_norm.weight", h)?,
            gate: load_linear(&src, "blk.0.ffn_gate", config.intermediate, h)?,
            up: load_linear(&src, "blk.0.ffn_up", config.intermediate, h)?,
            down: load_linear(&src, "blk.0.ffn_down", h, config.intermediate)?,
        };
        let head = load_linear(&src, "output", draft_vocab, h)?.weight;
        let d2t = src.offsets("d2t")?;
        if d2t.len() != draft_vocab {
            bail!("{}: d2t has {} entries, the draft vocabulary {draft_vocab}", src.path.display(), d2t.len());
        }
        let row_ids = d2t_target_ids(&d2t, t.vocab, &src.path)?;
        let geometry = Geometry::new(&config, None);
        Ok(Eagle3Draft {
            target,
            fc: Arc::new(load_linear(&src, "fc", h, 3 * h)?),
            layer: Arc::new(layer),
            input_norm: src.raw_vector("midlayer.input_layernorm.weight", h)?,
            hidden_norm: src.raw_vector("midlayer.hidden_norm.weight", h)?,
            norm: src.raw_vector("norm.weight", h)?,
            lm_head: LmHead { matrix: Arc::new(head), row_ids: Some(Arc::new(row_ids)), vocab: t.vocab },
            aux_layers,
            cache: Cache::new(1, &geometry),
            geometry,
            chooser: Chooser::default(),
            embeds: Vec::new(),
            attn_input: Vec::new(),
            last: Vec::new(),
            source: dir.to_path_buf(),
        })
    }

    /// The pre-norm outputs of every draft position the cache has not seen, each fed g = fc(its target layers).
    fn unseen_positions(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        let (h, n, seen) = (self.geometry.hidden, ctx.tokens.len(), self.cache.len());
        let mut g = vec![0.0; (n - 1 - seen) * h];
        self.fc.forward(&ctx.features.layers[seen * 3 * h..(n - 1) * 3 * h], &mut g, self.cache.matmul_scratch());
        self.step(&g, &ctx.tokens[seen + 1..n])
    }

    /// The final norm of the last pre-norm output: what the draft LM head reads.
    fn head_input(&self) -> Vec<f32> {
        let mut normed = vec![0.0; self.last.len()];
        super::model::rms_norm(&self.last, &self.norm, self.geometry.rms_eps, &mut normed);
        normed
    }

    /// Run inputs g (`[n, hidden]`) with the next tokens through the midlayer; returns the pre-norm outputs.
    fn step(&mut self, g: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let (h, eps) = (self.geometry.hidden, self.geometry.rms_eps);
        self.target.embed_into(tokens, &mut self.embeds)?;
        let n = tokens.len();
        let mut e = vec![0.0; n * h];
        let mut hn = vec![0.0; n * h];
        super::model::rms_norm(&self.embeds, &self.input_norm, eps, &mut e);
        super::model::rms_norm(g, &self.hidden_norm, eps, &mut hn);
        self.attn_input.clear();
        for (er, hr) in e.chunks_exact(h).zip(hn.chunks_exact(h)) {
            self.attn_input.extend_from_slice(er);
            self.attn_input.extend_from_slice(hr);
        }
        let mut x = g.to_vec();
        self.cache.advance(&self.geometry, std::slice::from_ref(&*self.layer), &mut x, Some(&self.attn_input), |_, _| {});
        Ok(x)
    }

    /// Another draft on the same weights with an empty cache (a slot of a batch).
    fn fresh(&self) -> Eagle3Draft<'a> {
        Eagle3Draft {
            target: self.target,
            fc: self.fc.clone(),
            layer: self.layer.clone(),
            input_norm: self.input_norm.clone(),
            hidden_norm: self.hidden_norm.clone(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            aux_layers: self.aux_layers.clone(),
            cache: Cache::new(1, &self.geometry),
            geometry: self.geometry.clone(),
            chooser: Chooser::default(),
            embeds: Vec::new(),
            attn_input: Vec::new(),
            last: Vec::new(),
            source: self.source.clone(),
        }
    }
}

impl Eagle3Draft<'_> {
    /// Teacher-forced draft logits over the draft vocabulary at every draft position of `ctx`, from an empty
    /// cache: `[tokens.len() - 1, draft vocab]`. For numerics checks against other implementations.
    pub fn teacher_forced_logits(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        self.reset();
        let n = ctx.tokens.len();
        let pre = self.unseen_positions(ctx)?;
        let mut normed = vec![0.0; pre.len()];
        super::model::rms_norm(&pre, &self.norm, self.geometry.rms_eps, &mut normed);
        let head = &self.lm_head.matrix;
        let mut logits = vec![0.0; (n - 1) * head.rows];
        head.matmul(&normed, &mut logits, self.cache.matmul_scratch());
        Ok(logits)
    }
}

impl Draft<Model> for Eagle3Draft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-3 head {}", self.source.display())
    }

    fn lm_head(&self) -> LmHead<Arc<Matrix>> {
        self.lm_head.clone()
    }

    fn target_layers(&self) -> Vec<usize> {
        self.aux_layers.clone()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        let pre = self.unseen_positions(ctx)?;
        self.last = pre[pre.len() - self.geometry.hidden..].to_vec();
        Ok(self.head_input())
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        let last = std::mem::take(&mut self.last);
        self.last = self.step(&last, &[token])?;
        Ok(self.head_input())
    }

    fn chooser(&mut self) -> &mut Chooser<Arc<Matrix>> {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        self.cache.truncate(before - 1);
        Ok(())
    }
}

/// A draft as loaded on the CPU engine, before it is boxed (or converted for another engine).
pub enum Loaded<'a> {
    Model(ModelDraft),
    Eagle(EagleDraft<'a>),
    Eagle3(Eagle3Draft<'a>),
}

/// Load the draft `kind` names for `target` (loaded from `target_spec`).
pub fn load<'a>(kind: &DraftKind, draft: Option<&str>, target: &'a crate::loading::target::Target, target_spec: &str) -> Result<Loaded<'a>> {
    let folder = |name: &str| -> Result<PathBuf> {
        let spec = draft.ok_or_else(|| anyhow!("--draft-kind {name} needs --draft"))?;
        crate::loading::target::resolve(spec)
    };
    Ok(match kind {
        DraftKind::Truncated(n) => {
            let mut model = crate::loading::target::Target::load(target_spec)?.model;
            model.truncate_layers(*n)?;
            Loaded::Model(ModelDraft::new(model, format!("first {n} layers of the target")))
        }
        DraftKind::Model => {
            let spec = draft.ok_or_else(|| anyhow!("--draft-kind model needs --draft"))?;
            let d = crate::loading::target::Target::load(spec)?;
            if d.tokenizer.vocab_hash() != target.tokenizer.vocab_hash() {
                bail!("draft model {spec} does not share the target's tokenizer (vocabularies differ)");
            }
            if d.model.config.vocab != target.model.config.vocab {
                bail!("draft model {spec} has {} vocabulary rows, the target {}", d.model.config.vocab, target.model.config.vocab);
            }
            Loaded::Model(ModelDraft::new(d.model, format!("draft model {spec}")))
        }
        DraftKind::Eagle => Loaded::Eagle(EagleDraft::load(&folder("eagle")?, &target.model)?),
        DraftKind::Eagle3 => Loaded::Eagle3(Eagle3Draft::load(&folder("eagle3")?, &target.model)?),
    })
}

impl<'a> Loaded<'a> {
    /// Another draft on the same weights with an empty cache: the slots of a batch share one copy of the weights.
    pub fn fresh(&self) -> Loaded<'a> {
        match self {
            Loaded::Model(d) => Loaded::Model(d.fresh()),
            Loaded::Eagle(d) => Loaded::Eagle(d.fresh()),
            Loaded::Eagle3(d) => Loaded::Eagle3(d.fresh()),
        }
    }

    pub fn boxed(self) -> Box<dyn Draft<Model> + 'a> {
        match self {
            Loaded::Model(d) => Box::new(d),
            Loaded::Eagle(d) => Box::new(d),
            Loaded::Eagle3(d) => Box::new(d),
        }
    }
}

/// Build the draft for `target` (loaded from `target_spec`) on the CPU engine.
pub fn build<'a>(kind: &DraftKind, draft: Option<&str>, target: &'a crate::loading::target::Target, target_spec: &str) -> Result<Box<dyn Draft<Model> + 'a>> {
    Ok(load(kind, draft, target, target_spec)?.boxed())
}
