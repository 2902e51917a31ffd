//! The drafts on the candle engine: EAGLE-1, EAGLE-3 and draft models, computing what the CPU engine's drafts
//! compute (`engine::cpu::draft`, whose loaders read and check the checkpoints) with candle tensors on the device.
//! Weights are converted once and shared (candle tensors are reference-counted); each `instance` has its own cache.

use super::llama::{norm_weights, rms_norm, Cache, KvPool, Layer, Llama, Proj, Random, Rope};
use super::{DeviceFeatures, DeviceHead};
use crate::engine::cpu::draft::Loaded;
use crate::engine::cpu::model::Geometry;
use crate::speculative::{Chooser, Context, Draft, LmHead, Positions};
use anyhow::{Context as _, Result};
use candle_core::Tensor;
use std::sync::Arc;

/// A draft's weights on the device, from which per-sequence drafts are made.
pub enum DraftWeights {
    Model { model: Arc<Llama>, label: String },
    Eagle(Arc<EagleWeights>),
    Eagle3(Arc<Eagle3Weights>),
}

impl DraftWeights {
    /// Convert a draft loaded on the CPU engine onto `target`'s device and dtype.
    pub fn from_engine(loaded: &Loaded, target: &Llama) -> Result<DraftWeights> {
        let (device, dtype) = (&target.device, target.dtype);
        let vector = |v: &[f32]| norm_weights(v, device, dtype);
        Ok(match loaded {
            Loaded::Model(d) => DraftWeights::Model { model: Arc::new(Llama::from_engine(&d.model, device, dtype)?), label: d.label.clone() },
            Loaded::Eagle(d) => DraftWeights::Eagle(Arc::new(EagleWeights {
                fc: Proj::from_engine(&d.fc, device, dtype)?,
                layer: Layer::from_engine(&d.layer, device, dtype)?,
                pool: layer_pool(&d.geometry, target),
                rope: Rope::of(&d.geometry),
                geometry: d.geometry.clone(),
                source: d.source.display().to_string(),
            })),
            Loaded::Eagle3(d) => DraftWeights::Eagle3(Arc::new(Eagle3Weights {
                fc: Proj::from_engine(&d.fc, device, dtype)?,
                layer: Layer::from_engine(&d.layer, device, dtype)?,
                input_norm: vector(&d.input_norm)?,
                hidden_norm: vector(&d.hidden_norm)?,
                norm: vector(&d.norm)?,
                lm_head: LmHead {
                    matrix: DeviceHead::new(super::llama::dense(&d.lm_head.matrix, device, dtype)?),
                    row_ids: d.lm_head.row_ids.clone(),
                    vocab: d.lm_head.vocab,
                },
                aux_layers: d.aux_layers.clone(),
                pool: layer_pool(&d.geometry, target),
                rope: Rope::of(&d.geometry),
                geometry: d.geometry.clone(),
                source: d.source.display().to_string(),
            })),
        })
    }

    /// An EAGLE-1 head with random weights of `target`'s shape: what drafting costs does not depend on the values.
    pub fn random_eagle(target: &Llama) -> Result<DraftWeights> {
        let (c, r) = (&target.config, Random { device: &target.device, dtype: target.dtype });
        Ok(DraftWeights::Eagle(Arc::new(EagleWeights {
            fc: r.proj(c.hidden, 2 * c.hidden)?,
            layer: Layer::random(c, &r, false)?,
            pool: layer_pool(&target.geometry, target),
            rope: Rope::of(&target.geometry),
            geometry: target.geometry.clone(),
            source: "random".into(),
        })))
    }

    /// A draft with an empty cache drafting for `target`.
    pub fn instance<'a>(&self, target: &'a Llama) -> Box<dyn Draft<Llama> + 'a> {
        match self {
            DraftWeights::Model { model, label } => {
                Box::new(ModelDraft { cache: model.new_cache(), model: model.clone(), label: label.clone(), chooser: Chooser::default() })
            }
            DraftWeights::Eagle(w) => Box::new(EagleDraft { w: w.clone(), target, cache: w.pool.cache(), last: None, chooser: Chooser::default() }),
            DraftWeights::Eagle3(w) => Box::new(Eagle3Draft { w: w.clone(), target, cache: w.pool.cache(), last: None, chooser: Chooser::default() }),
        }
    }
}

/// The pool of an EAGLE head's one layer: every instance's cache is a slot of it.
fn layer_pool(g: &Geometry, target: &Llama) -> Arc<KvPool> {
    KvPool::new(1, g.kv_heads, g.head_dim, target.dtype, &target.device)
}

/// A draft model sharing the target's tokenizer (independent, or the target's first layers).
pub struct ModelDraft {
    model: Arc<Llama>,
    cache: Cache,
    label: String,
    chooser: Chooser<DeviceHead>,
}

impl Draft<Llama> for ModelDraft {
    fn describe(&self) -> String {
        self.label.clone()
    }

    fn lm_head(&self) -> LmHead<DeviceHead> {
        LmHead::full(DeviceHead::new(self.model.lm_head().clone()))
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
    }

    fn catch_up(&mut self, ctx: &Context<DeviceFeatures>) -> Result<Tensor> {
        // Every token the draft has not seen, the last one (not yet verified) included.
        let hidden = self.model.forward(&ctx.tokens[self.cache.len()..], &mut self.cache)?;
        Ok(hidden.narrow(0, hidden.dim(0)? - 1, 1)?)
    }

    fn extend(&mut self, token: u32) -> Result<Tensor> {
        self.model.forward(&[token], &mut self.cache)
    }

    fn rollback(&mut self, before: usize, accepted: usize) -> Result<()> {
        // Accepted proposals are real tokens: keep their positions.
        let keep = self.cache.len().min(before + accepted);
        Positions::truncate(&mut self.cache, keep)
    }

    fn chooser(&mut self) -> &mut Chooser<DeviceHead> {
        &mut self.chooser
    }
}

/// EAGLE-1 (as `engine::cpu::draft::EagleDraft`): h = fc(cat(embed(t_{i+1}), f_i)), one decoder layer without input
/// norm, logits through the target's LM head.
pub struct EagleWeights {
    fc: Proj,
    layer: Layer,
    pool: Arc<KvPool>,
    geometry: Geometry,
    rope: Rope,
    source: String,
}

pub struct EagleDraft<'a> {
    w: Arc<EagleWeights>,
    target: &'a Llama,
    cache: Cache,
    /// The layer's output at the last drafted position: the stand-in feature for the next one.
    last: Option<Tensor>,
    chooser: Chooser<DeviceHead>,
}

impl EagleDraft<'_> {
    /// Run pairs (feature row, next token) through fc and the layer; returns the layer outputs `[n, hidden]`.
    fn step(&mut self, features: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let pair = Tensor::cat(&[&self.target.embed(tokens)?, features], 1)?;
        let x = self.w.fc.forward(&pair)?;
        let rope = self.w.rope.at(self.cache.len(), tokens.len(), &self.target.device)?;
        self.w.layer.forward(&self.w.geometry, &rope, &x, None, &mut self.cache)
    }
}

impl Draft<Llama> for EagleDraft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-1 head {} (candle)", self.w.source)
    }

    fn lm_head(&self) -> LmHead<DeviceHead> {
        LmHead::full(DeviceHead::new(self.target.lm_head().clone()))
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
        self.last = None;
    }

    fn catch_up(&mut self, ctx: &Context<DeviceFeatures>) -> Result<Tensor> {
        // Draft position j pairs (f_j, t_{j+1}); every j < n − 1 has a true target feature.
        let (n, seen) = (ctx.tokens.len(), self.cache.len());
        let features = ctx.features.hidden_rows(seen, n - 1 - seen)?;
        let out = self.step(&features, &ctx.tokens[seen + 1..n])?;
        let last = out.narrow(0, out.dim(0)? - 1, 1)?;
        self.last = Some(last.clone());
        Ok(last)
    }

    fn extend(&mut self, token: u32) -> Result<Tensor> {
        // No target feature exists yet for the drafted position: EAGLE feeds its own output instead.
        let last = self.last.take().context("extend before catch_up")?;
        let out = self.step(&last, &[token])?;
        self.last = Some(out.clone());
        Ok(out)
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        Positions::truncate(&mut self.cache, before - 1)
    }

    fn chooser(&mut self) -> &mut Chooser<DeviceHead> {
        &mut self.chooser
    }
}

/// EAGLE-3 (as `engine::cpu::draft::Eagle3Draft`): g = fc(the target's streams entering three layers); one midlayer
/// attending over cat(input_layernorm(embed(t)), hidden_norm(g)) with g as the residual; its own final norm and LM
/// head over a draft vocabulary.
pub struct Eagle3Weights {
    fc: Proj,
    layer: Layer,
    input_norm: Tensor,
    hidden_norm: Tensor,
    norm: Tensor,
    lm_head: LmHead<DeviceHead>,
    aux_layers: Vec<usize>,
    pool: Arc<KvPool>,
    geometry: Geometry,
    rope: Rope,
    source: String,
}

pub struct Eagle3Draft<'a> {
    w: Arc<Eagle3Weights>,
    target: &'a Llama,
    cache: Cache,
    /// The midlayer's pre-norm output at the last drafted position: the next position's input in place of g.
    last: Option<Tensor>,
    chooser: Chooser<DeviceHead>,
}

impl Eagle3Draft<'_> {
    /// Run inputs g `[n, hidden]` with the next tokens through the midlayer; returns the pre-norm outputs.
    fn step(&mut self, g: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let eps = self.w.geometry.rms_eps as f64;
        let e = rms_norm(&self.target.embed(tokens)?, &self.w.input_norm, eps)?;
        let attn_input = Tensor::cat(&[&e, &rms_norm(g, &self.w.hidden_norm, eps)?], 1)?;
        let rope = self.w.rope.at(self.cache.len(), tokens.len(), &self.target.device)?;
        self.w.layer.forward(&self.w.geometry, &rope, g, Some(&attn_input), &mut self.cache)
    }

    /// Keep the last pre-norm output and return its final norm: what the draft LM head reads.
    fn head_input(&mut self, last: Tensor) -> Result<Tensor> {
        let normed = rms_norm(&last, &self.w.norm, self.w.geometry.rms_eps as f64)?;
        self.last = Some(last);
        Ok(normed)
    }
}

impl Draft<Llama> for Eagle3Draft<'_> {
    fn describe(&self) -> String {
        format!("EAGLE-3 head {} (candle)", self.w.source)
    }

    fn lm_head(&self) -> LmHead<DeviceHead> {
        self.w.lm_head.clone()
    }

    fn target_layers(&self) -> Vec<usize> {
        self.w.aux_layers.clone()
    }

    fn reset(&mut self) {
        self.cache.truncate(0);
        self.last = None;
    }

    fn catch_up(&mut self, ctx: &Context<DeviceFeatures>) -> Result<Tensor> {
        let (n, seen) = (ctx.tokens.len(), self.cache.len());
        let g = self.w.fc.forward(&ctx.features.layer_rows(seen, n - 1 - seen)?)?;
        let pre = self.step(&g, &ctx.tokens[seen + 1..n])?;
        let last = pre.narrow(0, pre.dim(0)? - 1, 1)?;
        self.head_input(last)
    }

    fn extend(&mut self, token: u32) -> Result<Tensor> {
        let last = self.last.take().context("extend before catch_up")?;
        let pre = self.step(&last, &[token])?;
        self.head_input(pre)
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        Positions::truncate(&mut self.cache, before - 1)
    }

    fn chooser(&mut self) -> &mut Chooser<DeviceHead> {
        &mut self.chooser
    }
}

