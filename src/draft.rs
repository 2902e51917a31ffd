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

/// A draft's LM head before pruning: its rows and, when row r is not token r (EAGLE-3's draft vocabulary),
/// the target id of each row.
#[derive(Clone)]
pub struct LmHead {
    pub matrix: Arc<Matrix>,
    pub row_ids: Option<Arc<Vec<u32>>>,
    /// The target vocabulary the ids belong to.
    pub vocab: usize,
}

impl From<Arc<Matrix>> for LmHead {
    fn from(matrix: Arc<Matrix>) -> LmHead {
        let vocab = matrix.rows;
        LmHead { matrix, row_ids: None, vocab }
    }
}

impl LmHead {
    fn row_id(&self, row: usize) -> u32 {
        self.row_ids.as_ref().map_or(row as u32, |ids| ids[row])
    }
}

/// The LM head a draft proposes through: the full head, or pruned to a keep set.
pub struct DraftHead {
    lm: LmHead,
    /// Slice mode: the kept rows gathered into one matrix, and their target ids.
    sliced: Option<(Matrix, Vec<u32>)>,
    /// Mask mode: which rows are kept.
    mask: Option<Vec<bool>>,
    kept: usize,
}

impl DraftHead {
    pub fn new(lm: impl Into<LmHead>, keep: Option<KeepSet>, mode: HeadMode) -> Result<DraftHead> {
        let lm = lm.into();
        let rows = lm.matrix.rows;
        // A keep set holding every id is no pruning: use the full head in either mode.
        let Some(keep) = keep.filter(|k| k.ids.len() < lm.vocab) else {
            return Ok(DraftHead { lm, sliced: None, mask: None, kept: rows });
        };
        if keep.vocab != lm.vocab {
            bail!("keep set is for a vocabulary of {} ids, the draft head's vocabulary has {}", keep.vocab, lm.vocab);
        }
        let kept_rows: Vec<bool> = (0..rows).map(|r| keep.contains(lm.row_id(r))).collect();
        let kept = kept_rows.iter().filter(|&&k| k).count();
        if kept == 0 {
            bail!("the keep set shares no id with the draft head's vocabulary");
        }
        Ok(match mode {
            HeadMode::Slice => {
                let picked: Vec<u32> = (0..rows as u32).filter(|&r| kept_rows[r as usize]).collect();
                let ids = picked.iter().map(|&r| lm.row_id(r as usize)).collect();
                let sliced = Some((lm.matrix.select_rows(&picked), ids));
                DraftHead { lm, sliced, mask: None, kept }
            }
            HeadMode::Mask => DraftHead { lm, sliced: None, mask: Some(kept_rows), kept },
        })
    }

    /// The target vocabulary size.
    pub fn vocab(&self) -> usize {
        self.lm.vocab
    }

    /// Rows the head computes logits for that can be proposed.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Logits of one hidden row in head space: one entry per kept row (slice) or per row (full, mask; pruned
    /// rows are −∞). Kept rows keep their order, so slice and mask draw identically from one random stream.
    pub fn logits(&self, hidden: &[f32], out: &mut Vec<f32>, scratch: &mut MatmulScratch) {
        let m = self.sliced.as_ref().map_or(&*self.lm.matrix, |(m, _)| m);
        out.resize(m.rows, 0.0);
        m.matmul(hidden, out, scratch);
        if let Some(mask) = &self.mask {
            out.iter_mut().zip(mask).filter(|(_, &keep)| !keep).for_each(|(l, _)| *l = f32::NEG_INFINITY);
        }
    }

    /// Token id of a head-space index.
    pub fn id(&self, index: usize) -> u32 {
        match &self.sliced {
            Some((_, ids)) => ids[index],
            None => self.lm.row_id(index),
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
    /// The residual streams entering the draft's `target_layers`, concatenated per position:
    /// `[tokens.len() - 1, layers · hidden]` (EAGLE-3); empty for other drafts.
    pub layer_features: &'a [f32],
}

pub trait Draft {
    fn describe(&self) -> String;
    /// The LM head the draft's logits come from (before pruning).
    fn lm_head(&self) -> LmHead;
    /// Target layers whose input streams the draft reads (EAGLE-3's auxiliary hidden states).
    fn target_layers(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Forget the sequence (a new turn).
    fn reset(&mut self);
    /// Process what the draft has not seen of `ctx`; returns the head input (a hidden row) for the first draft.
    fn catch_up(&mut self, ctx: &Context) -> Result<Vec<f32>>;
    /// Feed the draft token just chosen; returns the head input for the next one.
    fn extend(&mut self, token: u32) -> Result<Vec<f32>>;
    /// Verification kept `accepted` of the proposals of a round that began with `before` tokens.
    fn rollback(&mut self, before: usize, accepted: usize);
    fn chooser(&mut self) -> &mut Chooser;

    /// Propose `k` tokens after `ctx.tokens`: catch up, then choose and extend one token at a time.
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
    ) -> Result<()> {
        out.clear();
        let mut row = self.catch_up(ctx)?;
        for step in 0..k {
            self.chooser().choose(head, &row, mode, sampling, rng, out);
            if step + 1 < k {
                row = self.extend(out.tokens[step])?;
            }
        }
        Ok(())
    }
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

    fn lm_head(&self) -> LmHead {
        self.model.lm_head_shared().into()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        // Every token the draft has not seen, the last one (not yet verified) included.
        let fwd = self.model.forward(&ctx.tokens[self.cache.len()..], &mut self.cache, &[], &[])?;
        Ok(fwd.hidden[fwd.hidden.len() - self.model.config.hidden..].to_vec())
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(self.model.forward(&[token], &mut self.cache, &[], &[])?.hidden)
    }

    fn chooser(&mut self) -> &mut Chooser {
        &mut self.chooser
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
    /// The layer's output at the last drafted position: the stand-in feature for the next one.
    last: Vec<f32>,
    source: PathBuf,
}

/// Named tensors of a checkpoint (safetensors or PyTorch pickle), answering to GGUF-style layer names.
struct TensorFile {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
    /// What the checkpoint calls its decoder layer: `layers.0.` (EAGLE-1) or `midlayer.` (EAGLE-3).
    layer_prefix: &'static str,
}

impl TensorFile {
    fn open(path: &Path) -> Result<TensorFile> {
        let tensors: HashMap<String, Tensor> = if path.extension().is_some_and(|e| e == "safetensors") {
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?
        } else {
            candle_core::pickle::read_all(path).map_err(|e| anyhow!("{}: {e}", path.display()))?.into_iter().collect()
        };
        Ok(TensorFile { path: path.to_path_buf(), tensors, layer_prefix: "layers.0." })
    }

    /// EAGLE checkpoints name layers as HF does, without the `model.` prefix.
    fn key(&self, name: &str) -> String {
        let hf = crate::weights::hf_name(name);
        let hf = hf.strip_prefix("model.").map(String::from).unwrap_or(hf);
        match hf.strip_prefix("layers.0.") {
            Some(rest) => format!("{}{rest}", self.layer_prefix),
            None => hf,
        }
    }

    fn get(&self, name: &str) -> Result<&Tensor> {
        self.raw(&self.key(name))
    }

    fn raw(&self, key: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| anyhow!("{}: tensor {key} is missing", self.path.display()))
    }

    fn raw_vector(&self, key: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.raw(key)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if v.len() != len {
            bail!("{}: {key} has {} values, expected {len}", self.path.display(), v.len());
        }
        Ok(v)
    }
}

impl WeightSource for TensorFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(&self.key(name))
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let t = self.get(name)?;
        let &[rows, cols] = t.dims() else {
            bail!("{}: tensor {} has shape {:?}, expected 2 dimensions", self.path.display(), self.key(name), t.dims())
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
        let src = TensorFile::open(&checkpoint(dir)?).with_context(|| format!("loading EAGLE head {}", dir.display()))?;
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
            last: Vec::new(),
            source: dir.to_path_buf(),
        })
    }

    /// The layer outputs of every draft position the cache has not seen. Draft position j pairs (f_j, t_{j+1});
    /// every j < n − 1 has a true target feature.
    fn unseen_positions(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        let (h, n, seen) = (self.geometry.hidden, ctx.tokens.len(), self.cache.len());
        self.step(&ctx.features[seen * h..(n - 1) * h], &ctx.tokens[seen + 1..n])
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
        self.cache.advance(&self.geometry, std::slice::from_ref(&self.layer), &mut x, None, |_, _| {});
        Ok(x)
    }
}

impl EagleDraft<'_> {
    /// Teacher-forced draft logits (full head) at every draft position of `ctx`, from an empty cache:
    /// `[tokens.len() - 1, vocab]`. For numerics checks against other implementations.
    pub fn teacher_forced_logits(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        self.reset();
        let out = self.unseen_positions(ctx)?;
        let n = ctx.tokens.len();
        let head = self.target.lm_head();
        let mut logits = vec![0.0; (n - 1) * head.rows];
        head.matmul(&out, &mut logits, self.cache.matmul_scratch());
        Ok(logits)
    }
}

impl Draft for EagleDraft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-1 head {}", self.source.display())
    }

    fn lm_head(&self) -> LmHead {
        self.target.lm_head_shared().into()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context) -> Result<Vec<f32>> {
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

    fn chooser(&mut self) -> &mut Chooser {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, _accepted: usize) {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        self.cache.truncate(before - 1);
    }
}

/// The weights file of an EAGLE head folder.
fn checkpoint(dir: &Path) -> Result<PathBuf> {
    ["model.safetensors", "pytorch_model.bin"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!("{}: no model.safetensors or pytorch_model.bin", dir.display()))
}

/// EAGLE-3 (SafeAILab `cnets.py`, vLLM `llama_eagle3.py`): g = fc(cat of the target's residual streams entering
/// three layers); one `midlayer` attending over cat(input_layernorm(embed(t)), hidden_norm(g)) with g as the
/// residual; its own final `norm` and `lm_head` over a draft vocabulary whose row d is target id d + d2t[d].
/// Later drafting steps feed the layer's own pre-norm output in place of g.
pub struct Eagle3Draft<'a> {
    target: &'a Model,
    fc: Linear,
    layer: Layer,
    input_norm: Vec<f32>,
    hidden_norm: Vec<f32>,
    norm: Vec<f32>,
    lm_head: LmHead,
    aux_layers: Vec<usize>,
    geometry: Geometry,
    cache: Cache,
    chooser: Chooser,
    embeds: Vec<f32>,
    attn_input: Vec<f32>,
    /// The midlayer's pre-norm output at the last drafted position: the next position's input in place of g.
    last: Vec<f32>,
    source: PathBuf,
}

impl<'a> Eagle3Draft<'a> {
    /// `dir` holds config.json (with `draft_vocab_size`) and the checkpoint with yuhuili's EAGLE-3 key names.
    pub fn load(dir: &Path, target: &'a Model) -> Result<Eagle3Draft<'a>> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", config_path.display()))?;
        // The checkpoint's architecture name is EAGLE-specific; the layer itself is a Llama layer.
        let mut config = crate::model::hf_config_from(raw.clone(), &config_path, true)?;
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
            None => vec![2, t.layers / 2, t.layers.saturating_sub(3)],
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
            ffn_norm: crate::model::load_norm(&src, "blk.0.ffn_norm.weight", h)?,
            gate: load_linear(&src, "blk.0.ffn_gate", config.intermediate, h)?,
            up: load_linear(&src, "blk.0.ffn_up", config.intermediate, h)?,
            down: load_linear(&src, "blk.0.ffn_down", h, config.intermediate)?,
        };
        let head = load_linear(&src, "output", draft_vocab, h)?.weight;
        let d2t = src.raw("d2t")?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        if d2t.len() != draft_vocab {
            bail!("{}: d2t has {} entries, the draft vocabulary {draft_vocab}", src.path.display(), d2t.len());
        }
        let row_ids = d2t
            .iter()
            .enumerate()
            .map(|(d, off)| match u32::try_from(d as i64 + off) {
                Ok(id) if (id as usize) < t.vocab => Ok(id),
                _ => Err(anyhow!("{}: d2t maps draft id {d} outside the target vocabulary", src.path.display())),
            })
            .collect::<Result<Vec<u32>>>()?;
        let geometry = Geometry::new(&config, None);
        Ok(Eagle3Draft {
            target,
            fc: load_linear(&src, "fc", h, 3 * h)?,
            layer,
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
    fn unseen_positions(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        let (h, n, seen) = (self.geometry.hidden, ctx.tokens.len(), self.cache.len());
        let mut g = vec![0.0; (n - 1 - seen) * h];
        self.fc.forward(&ctx.layer_features[seen * 3 * h..(n - 1) * 3 * h], &mut g, self.cache.matmul_scratch());
        self.step(&g, &ctx.tokens[seen + 1..n])
    }

    /// The final norm of the last pre-norm output: what the draft LM head reads.
    fn head_input(&self) -> Vec<f32> {
        let mut normed = vec![0.0; self.last.len()];
        crate::model::rms_norm(&self.last, &self.norm, self.geometry.rms_eps, &mut normed);
        normed
    }

    /// Run inputs g (`[n, hidden]`) with the next tokens through the midlayer; returns the pre-norm outputs.
    fn step(&mut self, g: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let (h, eps) = (self.geometry.hidden, self.geometry.rms_eps);
        self.target.embed_into(tokens, &mut self.embeds)?;
        let n = tokens.len();
        let mut e = vec![0.0; n * h];
        let mut hn = vec![0.0; n * h];
        crate::model::rms_norm(&self.embeds, &self.input_norm, eps, &mut e);
        crate::model::rms_norm(g, &self.hidden_norm, eps, &mut hn);
        self.attn_input.clear();
        for (er, hr) in e.chunks_exact(h).zip(hn.chunks_exact(h)) {
            self.attn_input.extend_from_slice(er);
            self.attn_input.extend_from_slice(hr);
        }
        let mut x = g.to_vec();
        self.cache.advance(&self.geometry, std::slice::from_ref(&self.layer), &mut x, Some(&self.attn_input), |_, _| {});
        Ok(x)
    }
}

impl Eagle3Draft<'_> {
    /// Teacher-forced draft logits over the draft vocabulary at every draft position of `ctx`, from an empty
    /// cache: `[tokens.len() - 1, draft vocab]`. For numerics checks against other implementations.
    pub fn teacher_forced_logits(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        self.reset();
        let n = ctx.tokens.len();
        let pre = self.unseen_positions(ctx)?;
        let mut normed = vec![0.0; pre.len()];
        crate::model::rms_norm(&pre, &self.norm, self.geometry.rms_eps, &mut normed);
        let head = &self.lm_head.matrix;
        let mut logits = vec![0.0; (n - 1) * head.rows];
        head.matmul(&normed, &mut logits, self.cache.matmul_scratch());
        Ok(logits)
    }
}

impl Draft for Eagle3Draft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-3 head {}", self.source.display())
    }

    fn lm_head(&self) -> LmHead {
        self.lm_head.clone()
    }

    fn target_layers(&self) -> Vec<usize> {
        self.aux_layers.clone()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context) -> Result<Vec<f32>> {
        let pre = self.unseen_positions(ctx)?;
        self.last = pre[pre.len() - self.geometry.hidden..].to_vec();
        Ok(self.head_input())
    }

    fn extend(&mut self, token: u32) -> Result<Vec<f32>> {
        let last = std::mem::take(&mut self.last);
        self.last = self.step(&last, &[token])?;
        Ok(self.head_input())
    }

    fn chooser(&mut self) -> &mut Chooser {
        &mut self.chooser
    }

    fn rollback(&mut self, before: usize, _accepted: usize) {
        self.cache.truncate(before - 1);
    }
}

/// Which kind of draft `--draft` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// An EAGLE-1 head folder.
    Eagle,
    /// An EAGLE-3 head folder.
    Eagle3,
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
            "eagle3" => Ok(DraftKind::Eagle3),
            "model" => Ok(DraftKind::Model),
            _ => match s.strip_prefix("truncated:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(DraftKind::Truncated(n)),
                _ => bail!("draft kind '{s}' is not one of eagle, eagle3, model, truncated:N (N ≥ 1)"),
            },
        }
    }
}

impl std::fmt::Display for DraftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftKind::Eagle => f.write_str("eagle"),
            DraftKind::Eagle3 => f.write_str("eagle3"),
            DraftKind::Model => f.write_str("model"),
            DraftKind::Truncated(n) => write!(f, "truncated:{n}"),
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
        DraftKind::Eagle3 => {
            let spec = draft.ok_or_else(|| anyhow!("--draft-kind eagle3 needs --draft"))?;
            let dir = crate::target::resolve(spec)?;
            Ok(Box::new(Eagle3Draft::load(&dir, &target.model)?))
        }
    }
}
