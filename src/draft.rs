//! Drafts behind one interface: an independent (or truncated-target) draft model and an EAGLE-1 head, each
//! proposing through a `DraftHead` that FR-Spec may prune to a keep set.

use crate::model::{load_layer, load_linear, Cache, Geometry, Layer, Linear, Model};
use crate::sampling::{argmax, draw, Sampling};
use crate::tensor::{MatmulScratch, Matrix};
use crate::vocab::KeepSet;
use crate::weights::WeightSource;
use anyhow::{anyhow, bail, Context as _, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a pruned head computes its logits. Both give the same distribution and, for the same random stream, the
/// same drafts: kept ids are sorted, so the sliced head's entries come in the masked head's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadMode {
    /// Gather the kept rows once into a [V′, H] matrix and compute V′ logits (the real speedup).
    Slice,
    /// Compute all V logits and set the pruned ones to −∞ (the seed's logits-processor experiment).
    Mask,
}

/// The LM head a draft proposes through: the full head, or pruned to a keep set.
pub struct DraftHead {
    full: Arc<Matrix>,
    sliced: Option<Matrix>,
    keep: Option<KeepSet>,
    mode: HeadMode,
}

impl DraftHead {
    pub fn new(full: Arc<Matrix>, keep: Option<KeepSet>, mode: HeadMode) -> Result<DraftHead> {
        if let Some(k) = &keep {
            if k.vocab != full.rows {
                bail!("keep set is for a vocabulary of {} ids, the draft head has {} rows", k.vocab, full.rows);
            }
        }
        // A keep set holding every id is no pruning: use the full head in either mode.
        let keep = keep.filter(|k| k.ids.len() < full.rows);
        let sliced = match (&keep, mode) {
            (Some(k), HeadMode::Slice) => Some(full.select_rows(&k.ids)),
            _ => None,
        };
        Ok(DraftHead { full, sliced, keep, mode })
    }

    pub fn vocab(&self) -> usize {
        self.full.rows
    }

    pub fn kept(&self) -> usize {
        self.keep.as_ref().map_or(self.full.rows, |k| k.ids.len())
    }

    /// Logits of one hidden row in head space: V′ entries (slice) or V entries (full, mask).
    pub fn logits(&self, hidden: &[f32], out: &mut Vec<f32>, scratch: &mut MatmulScratch) {
        let m = self.sliced.as_ref().unwrap_or(&self.full);
        out.resize(m.rows, 0.0);
        m.matmul(hidden, out, scratch);
        if let (Some(keep), HeadMode::Mask) = (&self.keep, self.mode) {
            let mut next = keep.ids.iter().peekable();
            for (id, l) in out.iter_mut().enumerate() {
                if next.peek() == Some(&&(id as u32)) {
                    next.next();
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Token id of a head-space index.
    pub fn id(&self, index: usize) -> u32 {
        match &self.sliced {
            Some(_) => self.keep.as_ref().expect("a sliced head has a keep set").ids[index],
            None => index as u32,
        }
    }

    /// Head-space index of a token id, None when the id is pruned.
    pub fn index(&self, id: u32) -> Option<usize> {
        match (&self.sliced, &self.keep) {
            (Some(_), Some(k)) => k.index_of(id),
            (None, Some(k)) if !k.contains(id) => None,
            _ => Some(id as usize),
        }
    }
}

/// How drafts are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftMode {
    /// vLLM: the draft's argmax, treated as a point mass (acceptance probability p(x)).
    Argmax,
    /// Full speculative sampling: draw from the draft's softmax q; accept with min(1, p/q).
    Sample,
}

/// The k tokens of one drafting round and what verification needs of the draft's distributions.
#[derive(Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// q(token) for each proposed token.
    pub q_token: Vec<f32>,
    /// Per step, q over head space; empty when q is a point mass (argmax drafts, or greedy sampling).
    pub q: Vec<Vec<f32>>,
}

impl Proposal {
    fn clear(&mut self) {
        self.tokens.clear();
        self.q_token.clear();
    }
}

/// Reusable buffers for choosing a draft token.
#[derive(Default)]
pub struct Chooser {
    logits: Vec<f32>,
    order: Vec<u32>,
    pub scratch: MatmulScratch,
}

impl Chooser {
    /// Choose the next draft token from a hidden row and record it (with q) in `out`.
    fn choose(&mut self, head: &DraftHead, hidden: &[f32], mode: DraftMode, sampling: Sampling, rng: &mut dyn rand::Rng, out: &mut Proposal) {
        head.logits(hidden, &mut self.logits, &mut self.scratch);
        let step = out.tokens.len();
        if mode == DraftMode::Argmax || sampling.is_greedy() {
            out.tokens.push(head.id(argmax(&self.logits) as usize));
            out.q_token.push(1.0);
            if out.q.len() > step {
                out.q[step].clear();
            }
            return;
        }
        if out.q.len() <= step {
            out.q.resize_with(step + 1, Vec::new);
        }
        let q = &mut out.q[step];
        sampling.distribution(&self.logits, q, &mut self.order);
        let index = draw(q, rng) as usize;
        out.tokens.push(head.id(index));
        out.q_token.push(q[index]);
    }
}

/// The sequence so far as the draft sees it.
pub struct Context<'a> {
    /// Every token; the last one has not been through the target yet.
    pub tokens: &'a [u32],
    /// The target's post-norm hidden states, `[tokens.len() - 1, hidden]`.
    pub features: &'a [f32],
}

pub trait Draft {
    fn describe(&self) -> String;
    /// The LM head the draft's logits come from (before pruning).
    fn lm_head(&self) -> Arc<Matrix>;
    /// Forget the sequence (a new turn).
    fn reset(&mut self);
    /// Propose `k` tokens after `ctx.tokens`.
    #[allow(clippy::too_many_arguments)]
    fn propose(
        &mut self,
        ctx: &Context,
        k: usize,
        head: &DraftHead,
        mode: DraftMode,
        sampling: Sampling,
        rng: &mut dyn rand::Rng,
        out: &mut Proposal,
    ) -> Result<()>;
    /// Verification kept `accepted` of the proposals of a round that began with `before` tokens.
    fn rollback(&mut self, before: usize, accepted: usize);
}

/// A draft model sharing the target's tokenizer: an independent model or a truncated copy of the target.
pub struct ModelDraft {
    model: Model,
    cache: Cache,
    chooser: Chooser,
    label: String,
}

impl ModelDraft {
    pub fn new(model: Model, label: String) -> ModelDraft {
        let cache = model.new_cache();
        ModelDraft { model, cache, chooser: Chooser::default(), label }
    }
}

impl Draft for ModelDraft {
    fn describe(&self) -> String {
        self.label.clone()
    }

    fn lm_head(&self) -> Arc<Matrix> {
        self.model.lm_head_shared()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn propose(
        &mut self,
        ctx: &Context,
        k: usize,
        head: &DraftHead,
        mode: DraftMode,
        sampling: Sampling,
        rng: &mut dyn rand::Rng,
        out: &mut Proposal,
    ) -> Result<()> {
        out.clear();
        let h = self.model.config.hidden;
        // Catch up on every token the draft has not seen (the last one included), then extend one at a time.
        let mut fwd = self.model.forward(&ctx.tokens[self.cache.len()..], &mut self.cache, &[], &[])?;
        for step in 0..k {
            let rows = fwd.hidden.len() / h;
            let last = &fwd.hidden[(rows - 1) * h..];
            self.chooser.choose(head, last, mode, sampling, rng, out);
            if step + 1 < k {
                fwd = self.model.forward(&out.tokens[step..step + 1], &mut self.cache, &[], &[])?;
            }
        }
        Ok(())
    }

    fn rollback(&mut self, before: usize, accepted: usize) {
        // Accepted proposals are real tokens: keep their positions.
        self.cache.truncate(self.cache.len().min(before + accepted));
    }
}

/// EAGLE-1 (SafeAILab `cnets1.py`): h = fc(cat(embed(t_{i+1}), f_i)), one decoder layer without input norm,
/// no final norm, logits through the target's LM head. Reuses the target's embedding.
pub struct EagleDraft<'a> {
    target: &'a Model,
    fc: Linear,
    layer: Layer,
    geometry: Geometry,
    cache: Cache,
    chooser: Chooser,
    input: Vec<f32>,
    pair: Vec<f32>,
    source: PathBuf,
}

/// Named tensors of a checkpoint (safetensors or PyTorch pickle), answering to GGUF-style layer names.
struct TensorFile {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl TensorFile {
    fn open(path: &Path) -> Result<TensorFile> {
        let tensors: HashMap<String, Tensor> = if path.extension().is_some_and(|e| e == "safetensors") {
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?
        } else {
            candle_core::pickle::read_all(path).map_err(|e| anyhow!("{}: {e}", path.display()))?.into_iter().collect()
        };
        Ok(TensorFile { path: path.to_path_buf(), tensors })
    }

    /// EAGLE checkpoints name layers as HF does, without the `model.` prefix.
    fn key(name: &str) -> String {
        let hf = crate::weights::hf_name(name);
        hf.strip_prefix("model.").map(String::from).unwrap_or(hf)
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        let key = Self::key(name);
        self.tensors.get(&key).ok_or_else(|| anyhow!("{}: tensor {key} is missing", self.path.display()))
    }
}

impl WeightSource for TensorFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(&Self::key(name))
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let t = self.get(name)?;
        let &[rows, cols] = t.dims() else {
            bail!("{}: tensor {} has shape {:?}, expected 2 dimensions", self.path.display(), Self::key(name), t.dims())
        };
        let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok(Matrix { rows, cols, storage: crate::tensor::Storage::F32(values) })
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.get(name)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}

impl<'a> EagleDraft<'a> {
    /// `dir` holds config.json and model.safetensors or pytorch_model.bin, with yuhuili's key names.
    pub fn load(dir: &Path, target: &'a Model) -> Result<EagleDraft<'a>> {
        let config_path = dir.join("config.json");
        let mut config = crate::model::hf_config(&config_path)?;
        let t = &target.config;
        if config.hidden != t.hidden {
            bail!("{}: EAGLE hidden size {} ≠ the target's {}", config_path.display(), config.hidden, t.hidden);
        }
        if config.vocab != t.vocab {
            bail!("{}: EAGLE vocabulary {} ≠ the target's {}", config_path.display(), config.vocab, t.vocab);
        }
        config.layers = 1;
        let weights = ["model.safetensors", "pytorch_model.bin"]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| anyhow!("{}: no model.safetensors or pytorch_model.bin", dir.display()))?;
        let src = TensorFile::open(&weights).with_context(|| format!("loading EAGLE head {}", dir.display()))?;
        let fc = load_linear(&src, "fc", config.hidden, 2 * config.hidden)?;
        let layer = load_layer(&src, &config, "blk.0", false)?;
        let geometry = Geometry::new(&config, None);
        let cache = Cache::new(1, &geometry);
        Ok(EagleDraft {
            target,
            fc,
            layer,
            geometry,
            cache,
            chooser: Chooser::default(),
            input: Vec::new(),
            pair: Vec::new(),
            source: dir.to_path_buf(),
        })
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
        self.cache.advance(&self.geometry, std::slice::from_ref(&self.layer), &mut x, |_, _| {});
        Ok(x)
    }
}

impl Draft for EagleDraft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-1 head {}", self.source.display())
    }

    fn lm_head(&self) -> Arc<Matrix> {
        self.target.lm_head_shared()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn propose(
        &mut self,
        ctx: &Context,
        k: usize,
        head: &DraftHead,
        mode: DraftMode,
        sampling: Sampling,
        rng: &mut dyn rand::Rng,
        out: &mut Proposal,
    ) -> Result<()> {
        out.clear();
        let h = self.geometry.hidden;
        let n = ctx.tokens.len();
        // Draft position j pairs (f_j, t_{j+1}); every j < n - 1 has a true target feature.
        let seen = self.cache.len();
        let mut g = self.step(&ctx.features[seen * h..(n - 1) * h], &ctx.tokens[seen + 1..n])?;
        for step in 0..k {
            let last = g[g.len() - h..].to_vec();
            self.chooser.choose(head, &last, mode, sampling, rng, out);
            if step + 1 < k {
                // No target feature exists yet for the drafted position: EAGLE feeds its own output instead.
                g = self.step(&last, &out.tokens[step..step + 1])?;
            }
        }
        Ok(())
    }

    fn rollback(&mut self, before: usize, _accepted: usize) {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        self.cache.truncate(before - 1);
    }
}

/// Which kind of draft `--draft` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// An EAGLE-1 head folder.
    Eagle,
    /// An independent model sharing the target's tokenizer.
    Model,
    /// The target's first N layers (+ final norm + LM head); needs no `--draft`.
    Truncated(usize),
}

impl std::str::FromStr for DraftKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<DraftKind> {
        match s {
            "eagle" => Ok(DraftKind::Eagle),
            "model" => Ok(DraftKind::Model),
            _ => match s.strip_prefix("truncated:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(DraftKind::Truncated(n)),
                _ => bail!("draft kind '{s}' is not one of eagle, model, truncated:N (N ≥ 1)"),
            },
        }
    }
}

/// Build the draft for `target` (loaded from `target_spec`).
pub fn build<'a>(
    kind: &DraftKind,
    draft: Option<&str>,
    target: &'a crate::target::Target,
    target_spec: &str,
) -> Result<Box<dyn Draft + 'a>> {
    match kind {
        DraftKind::Truncated(n) => {
            let mut model = crate::target::Target::load(target_spec)?.model;
            model.truncate_layers(*n)?;
            Ok(Box::new(ModelDraft::new(model, format!("first {n} layers of the target"))))
        }
        DraftKind::Model => {
            let spec = draft.ok_or_else(|| anyhow!("--draft-kind model needs --draft"))?;
            let d = crate::target::Target::load(spec)?;
            if d.tokenizer.vocab_hash() != target.tokenizer.vocab_hash() {
                bail!("draft model {spec} does not share the target's tokenizer (vocabularies differ)");
            }
            if d.model.config.vocab != target.model.config.vocab {
                bail!("draft model {spec} has {} vocabulary rows, the target {}", d.model.config.vocab, target.model.config.vocab);
            }
            Ok(Box::new(ModelDraft::new(d.model, format!("draft model {spec}"))))
        }
        DraftKind::Eagle => {
            let spec = draft.ok_or_else(|| anyhow!("--draft-kind eagle needs --draft"))?;
            let dir = crate::target::resolve(spec)?;
            Ok(Box::new(EagleDraft::load(&dir, &target.model)?))
        }
    }
}
