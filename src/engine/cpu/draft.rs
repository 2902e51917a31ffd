//! The drafts on the CPU engine: an independent (or truncated-target) draft model, EAGLE-1 and EAGLE-3 heads, each
//! proposing through a `DraftHead` that FR-Spec may prune to a keep set.

use super::model::{load_layer, load_linear, Cache, Geometry, Layer, Linear, Model};
use super::tensor::{MatmulScratch, Matrix};
use super::CpuFeatures;
use crate::speculative::{Chooser, Context, Draft, DraftKind, Feed, LmHead, SharedWeights};
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

/// EAGLE-1 (SafeAILab `cnets1.py`): h = fc(cat(embed(t_{i+1}), f_i)), one decoder layer without input norm,
/// no final norm, logits through the target's LM head. Reuses the target's embedding.
pub struct EagleWeights {
    pub(crate) fc: Linear,
    pub(crate) layer: Layer,
    pub(crate) geometry: Geometry,
    pub(crate) source: PathBuf,
}

/// EAGLE-3 (SafeAILab `cnets.py`, vLLM `llama_eagle3.py`): g = fc(cat of the target's residual streams entering
/// three layers); one `midlayer` attending over cat(input_layernorm(embed(t)), hidden_norm(g)) with g as the
/// residual; its own final `norm` and `lm_head` over a draft vocabulary whose row d is target id d + d2t[d].
/// Later drafting steps feed the layer's own pre-norm output in place of g.
pub struct Eagle3Weights {
    pub(crate) fc: Linear,
    pub(crate) layer: Layer,
    pub(crate) input_norm: Vec<f32>,
    pub(crate) hidden_norm: Vec<f32>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: LmHead<Arc<Matrix>>,
    pub(crate) aux_layers: Vec<usize>,
    pub(crate) geometry: Geometry,
    pub(crate) source: PathBuf,
}

/// The head an EAGLE draft runs; its weights are shared by every draft made from it.
#[derive(Clone)]
pub enum Head {
    Eagle(Arc<EagleWeights>),
    Eagle3(Arc<Eagle3Weights>),
}

impl Head {
    /// The one layer and its geometry.
    fn layer(&self) -> (&Layer, &Geometry) {
        match self {
            Head::Eagle(w) => (&w.layer, &w.geometry),
            Head::Eagle3(w) => (&w.layer, &w.geometry),
        }
    }

    /// What identifies the weights: drafts on the same ones run together.
    fn weights(&self) -> *const () {
        match self {
            Head::Eagle(w) => Arc::as_ptr(w).cast(),
            Head::Eagle3(w) => Arc::as_ptr(w).cast(),
        }
    }

    /// Append the stream the layer reads at target positions `positions`: EAGLE-1 the target's post-norm hidden
    /// states, EAGLE-3 fc over its captured layers.
    fn stream(&self, features: &CpuFeatures, positions: std::ops::Range<usize>, out: &mut Vec<f32>, scratch: &mut MatmulScratch) {
        let h = self.layer().1.hidden;
        match self {
            Head::Eagle(_) => out.extend_from_slice(&features.hidden[positions.start * h..positions.end * h]),
            Head::Eagle3(w) => {
                let at = out.len();
                out.resize(at + positions.len() * h, 0.0);
                w.fc.forward(&features.layers[positions.start * 3 * h..positions.end * 3 * h], &mut out[at..], scratch);
            }
        }
    }

    /// The layer's input (into `w.x`) and, for EAGLE-3, its attention's input (into `w.attn_input`), of the stream
    /// rows `w.streams` paired with the embedded next tokens `w.embedded`.
    fn inputs(&self, w: &mut FeedBuffers, scratch: &mut MatmulScratch) {
        let h = self.layer().1.hidden;
        let interleave = |out: &mut Vec<f32>, a: &[f32], b: &[f32]| {
            out.clear();
            for (a, b) in a.chunks_exact(h).zip(b.chunks_exact(h)) {
                out.extend_from_slice(a);
                out.extend_from_slice(b);
            }
        };
        match self {
            Head::Eagle(e) => {
                interleave(&mut w.pair, &w.embedded, &w.streams);
                w.x.resize(w.streams.len(), 0.0);
                e.fc.forward(&w.pair, &mut w.x, scratch);
            }
            Head::Eagle3(e) => {
                let eps = e.geometry.rms_eps;
                w.x.resize(w.streams.len(), 0.0);
                w.normed.resize(w.streams.len(), 0.0);
                super::model::rms_norm(&w.embedded, &e.input_norm, eps, &mut w.x);
                super::model::rms_norm(&w.streams, &e.hidden_norm, eps, &mut w.normed);
                interleave(&mut w.attn_input, &w.x, &w.normed);
                w.x.clone_from(&w.streams);
            }
        }
    }

    /// What the draft LM head reads of layer output rows: EAGLE-1 the rows, EAGLE-3 their final norm.
    fn head_input(&self, rows: &[f32]) -> Vec<f32> {
        match self {
            Head::Eagle(_) => rows.to_vec(),
            Head::Eagle3(w) => {
                let mut normed = vec![0.0; rows.len()];
                super::model::rms_norm(rows, &w.norm, w.geometry.rms_eps, &mut normed);
                normed
            }
        }
    }
}

/// The buffers of a feed, reused from call to call.
#[derive(Default)]
struct FeedBuffers {
    tokens: Vec<u32>,
    rows: Vec<usize>,
    streams: Vec<f32>,
    embedded: Vec<f32>,
    pair: Vec<f32>,
    normed: Vec<f32>,
    attn_input: Vec<f32>,
    x: Vec<f32>,
}

/// An EAGLE draft's own part: its head, its cache and the layer's output at its last drafted position, the next
/// position's stream in place of a target feature. Drafts on the same weights are fed in one forward
/// (`feed_together`).
pub struct DraftState {
    head: Head,
    cache: Cache,
    last: Vec<f32>,
    work: FeedBuffers,
}

impl SharedWeights for DraftState {
    fn weights(&self) -> *const () {
        self.head.weights()
    }
}

/// Run drafts on the same weights through their layer in one forward (one pass over its weights): each draft's
/// stream since it last caught up (or its own last output) paired with its next tokens, at its own positions of its
/// own cache. The outputs are left in the first draft's `work.x`, `work.rows[i]` rows for draft i, in order; each
/// draft's last one becomes its `last`. A draft's rows are what it gets alone, bit for bit.
fn forward_together(target: &Model, states: &mut [&mut DraftState], feeds: &[Feed<'_, CpuFeatures>]) -> Result<()> {
    let head = states.first().context("no draft to feed")?.head.clone();
    if states.iter().any(|s| s.head.weights() != head.weights()) {
        bail!("drafts fed together run the same weights");
    }
    let (layer, g) = head.layer();
    let h = g.hidden;
    let mut w = std::mem::take(&mut states[0].work);
    w.streams.clear();
    w.tokens.clear();
    w.rows.clear();
    for (s, feed) in states.iter_mut().zip(feeds) {
        let seen = s.cache.len();
        let fed = match feed {
            // Draft position j pairs (f_j, t_{j+1}); every j < n − 1 has a true target feature.
            Feed::CatchUp(ctx) => {
                let n = ctx.tokens.len();
                if n < seen + 2 {
                    bail!("a draft catching up at {seen} positions has nothing to catch up on ({n} tokens)");
                }
                head.stream(ctx.features, seen..n - 1, &mut w.streams, s.cache.matmul_scratch());
                &ctx.tokens[seen + 1..n]
            }
            // No target feature exists yet for a drafted position: EAGLE feeds its own output instead.
            Feed::Extend(token) => {
                if s.last.is_empty() {
                    bail!("a draft was extended before it caught up");
                }
                w.streams.extend_from_slice(&s.last);
                std::slice::from_ref(token)
            }
        };
        w.tokens.extend_from_slice(fed);
        w.rows.push(fed.len());
    }
    target.embed_into(&w.tokens, &mut w.embedded)?;
    head.inputs(&mut w, states[0].cache.matmul_scratch());
    let mut caches: Vec<&mut Cache> = states.iter_mut().map(|s| &mut s.cache).collect();
    let first_attn_input = matches!(head, Head::Eagle3(_)).then_some(&w.attn_input[..]);
    super::model::advance_sequences(g, std::slice::from_ref(layer), &mut caches, &w.rows, &mut w.x, first_attn_input, |_, _| {});
    let mut end = 0;
    for (s, &n) in states.iter_mut().zip(&w.rows) {
        end += n;
        s.last.clear();
        s.last.extend_from_slice(&w.x[(end - 1) * h..end * h]);
    }
    states[0].work = w;
    Ok(())
}

/// `forward_together`, returning each draft's head input, in order.
pub fn feed_together(target: &Model, states: &mut [&mut DraftState], feeds: &[Feed<'_, CpuFeatures>]) -> Result<Vec<Vec<f32>>> {
    forward_together(target, states, feeds)?;
    Ok(states.iter().map(|s| s.head.head_input(&s.last)).collect())
}

/// An EAGLE-1 or EAGLE-3 draft on this engine.
pub struct EagleDraft<'a> {
    state: DraftState,
    target: &'a Model,
    chooser: Chooser<Arc<Matrix>>,
}

/// An EAGLE head's config (read from `path`) as the config of its one layer, once its width and vocabulary are found
/// to be the target's.
fn one_layer(mut config: super::model::Config, target: &Model, path: &Path, kind: &str) -> Result<super::model::Config> {
    let t = &target.config;
    if config.hidden != t.hidden {
        bail!("{}: {kind} hidden size {} ≠ the target's {}", path.display(), config.hidden, t.hidden);
    }
    if config.vocab != t.vocab {
        bail!("{}: {kind} vocabulary {} ≠ the target's {}", path.display(), config.vocab, t.vocab);
    }
    config.layers = 1;
    Ok(config)
}

impl<'a> EagleDraft<'a> {
    /// An EAGLE-1 head: `dir` holds config.json and model.safetensors or pytorch_model.bin, with yuhuili's key names.
    pub fn load(dir: &Path, target: &'a Model) -> Result<EagleDraft<'a>> {
        let config_path = dir.join("config.json");
        let config = one_layer(super::model::hf_config(&config_path)?, target, &config_path, "EAGLE")?;
        let src = TensorFile::open(&checkpoint(dir)?).with_context(|| format!("loading EAGLE head {}", dir.display()))?;
        let weights = EagleWeights {
            fc: load_linear(&src, "fc", config.hidden, 2 * config.hidden)?,
            layer: load_layer(&src, &config, "blk.0", false)?,
            geometry: Geometry::new(&config, None),
            source: dir.to_path_buf(),
        };
        Ok(EagleDraft::of(Head::Eagle(Arc::new(weights)), target))
    }

    /// An EAGLE-3 head: `dir` holds config.json (with `draft_vocab_size`) and the checkpoint with yuhuili's EAGLE-3
    /// key names.
    pub fn load_eagle3(dir: &Path, target: &'a Model) -> Result<EagleDraft<'a>> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", config_path.display()))?;
        // The checkpoint's architecture name is EAGLE-specific; the layer itself is a Llama layer.
        let config = one_layer(super::model::hf_config_from(raw.clone(), &config_path, true)?, target, &config_path, "EAGLE-3")?;
        let t = &target.config;
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
        let weights = Eagle3Weights {
            fc: load_linear(&src, "fc", h, 3 * h)?,
            layer,
            input_norm: src.raw_vector("midlayer.input_layernorm.weight", h)?,
            hidden_norm: src.raw_vector("midlayer.hidden_norm.weight", h)?,
            norm: src.raw_vector("norm.weight", h)?,
            lm_head: LmHead { matrix: Arc::new(head), row_ids: Some(Arc::new(row_ids)), vocab: t.vocab },
            aux_layers,
            geometry: Geometry::new(&config, None),
            source: dir.to_path_buf(),
        };
        Ok(EagleDraft::of(Head::Eagle3(Arc::new(weights)), target))
    }

    /// A draft of `head` with an empty cache.
    fn of(head: Head, target: &'a Model) -> EagleDraft<'a> {
        let cache = Cache::new(1, head.layer().1);
        EagleDraft { state: DraftState { head, cache, last: Vec::new(), work: FeedBuffers::default() }, target, chooser: Chooser::default() }
    }

    /// The head this draft runs.
    pub fn head(&self) -> &Head {
        &self.state.head
    }

    /// Another draft on the same weights with an empty cache (a slot of a batch).
    fn fresh(&self) -> EagleDraft<'a> {
        EagleDraft::of(self.state.head.clone(), self.target)
    }

    fn feed(&mut self, feed: Feed<'_, CpuFeatures>) -> Result<Vec<f32>> {
        Ok(feed_together(self.target, &mut [&mut self.state], &[feed])?.pop().expect("one draft fed"))
    }

    /// Teacher-forced draft logits (full head: the target's for EAGLE-1, the draft vocabulary for EAGLE-3) at every
    /// draft position of `ctx`, from an empty cache: `[tokens.len() - 1, head rows]`. For numerics checks against
    /// other implementations.
    pub fn teacher_forced_logits(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        self.reset();
        forward_together(self.target, &mut [&mut self.state], &[Feed::CatchUp(*ctx)])?;
        let inputs = self.state.head.head_input(&self.state.work.x);
        let head = self.lm_head().matrix;
        let mut logits = vec![0.0; (ctx.tokens.len() - 1) * head.rows];
        head.matmul(&inputs, &mut logits, self.state.cache.matmul_scratch());
        Ok(logits)
    }
}

impl Draft<Model> for EagleDraft<'_> {
    fn describe(&self) -> String {
        match &self.state.head {
            Head::Eagle(w) => format!("EAGLE-1 head {}", w.source.display()),
            Head::Eagle3(w) => format!("EAGLE-3 head {}", w.source.display()),
        }
    }

    fn lm_head(&self) -> LmHead<Arc<Matrix>> {
        match &self.state.head {
            Head::Eagle(_) => LmHead::full(self.target.lm_head_shared()),
            Head::Eagle3(w) => w.lm_head.clone(),
        }
    }

    fn target_layers(&self) -> Vec<usize> {
        match &self.state.head {
            Head::Eagle(_) => Vec::new(),
            Head::Eagle3(w) => w.aux_layers.clone(),
        }
    }

    fn reset(&mut self) {
        self.state.cache.truncate(0);
        self.state.last.clear();
    }

    fn catch_up(&mut self, ctx: &Context<CpuFeatures>) -> Result<Vec<f32>> {
        self.feed(Feed::CatchUp(*ctx))
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        self.feed(Feed::Extend(token))
    }

    fn chooser(&mut self) -> &mut Chooser<Arc<Matrix>> {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        self.state.cache.truncate(before - 1);
        Ok(())
    }

    fn state(&mut self) -> Option<&mut DraftState> {
        Some(&mut self.state)
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

/// A draft as loaded on the CPU engine, before it is boxed (or converted for another engine).
pub enum Loaded<'a> {
    Model(ModelDraft),
    Eagle(EagleDraft<'a>),
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
        DraftKind::Eagle3 => Loaded::Eagle(EagleDraft::load_eagle3(&folder("eagle3")?, &target.model)?),
    })
}

impl<'a> Loaded<'a> {
    /// Another draft on the same weights with an empty cache: the slots of a batch share one copy of the weights.
    pub fn fresh(&self) -> Loaded<'a> {
        match self {
            Loaded::Model(d) => Loaded::Model(d.fresh()),
            Loaded::Eagle(d) => Loaded::Eagle(d.fresh()),
        }
    }

    pub fn boxed(self) -> Box<dyn Draft<Model> + 'a> {
        match self {
            Loaded::Model(d) => Box::new(d),
            Loaded::Eagle(d) => Box::new(d),
        }
    }
}

/// Build the draft for `target` (loaded from `target_spec`) on the CPU engine.
pub fn build<'a>(kind: &DraftKind, draft: Option<&str>, target: &'a crate::loading::target::Target, target_spec: &str) -> Result<Box<dyn Draft<Model> + 'a>> {
    Ok(load(kind, draft, target, target_spec)?.boxed())
}
