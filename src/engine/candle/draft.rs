//! The drafts on the candle engine: EAGLE-1, EAGLE-3 and draft models, computing what the CPU engine's drafts
//! compute (`engine::cpu::draft`, whose loaders read and check the checkpoints) with candle tensors on the device.
//! Weights are converted once and shared (candle tensors are reference-counted); an EAGLE `instance`'s cache is a slot
//! of its weights' pool, so the loop's drafts on the same weights are fed in one forward (`feed_together`).

use super::llama::{norm_weights, rms_norm, Cache, KvPool, Layer, Llama, Proj, Random, Rope};
use super::{stack, DeviceFeatures, DeviceHead, DeviceRow};
use crate::engine::cpu::draft::{self as cpu_draft, Loaded};
use crate::engine::cpu::model::Geometry;
use crate::speculative::{Chooser, Context, Draft, Feed, LmHead, Positions, SharedWeights};
use anyhow::{bail, Context as _, Result};
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
            Loaded::Eagle(d) => match d.head() {
                cpu_draft::Head::Eagle(d) => DraftWeights::Eagle(Arc::new(EagleWeights {
                    fc: Proj::from_engine(&d.fc, device, dtype)?,
                    layer: Layer::from_engine(&d.layer, device, dtype)?,
                    pool: layer_pool(&d.geometry, target),
                    rope: Rope::of(&d.geometry),
                    geometry: d.geometry.clone(),
                    source: d.source.display().to_string(),
                })),
                cpu_draft::Head::Eagle3(d) => DraftWeights::Eagle3(Arc::new(Eagle3Weights {
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
            },
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
            DraftWeights::Eagle(w) => Box::new(EagleDraft { state: DraftState { head: Head::Eagle(w.clone()), cache: w.pool.cache(), last: None }, target, chooser: Chooser::default() }),
            DraftWeights::Eagle3(w) => Box::new(EagleDraft { state: DraftState { head: Head::Eagle3(w.clone()), cache: w.pool.cache(), last: None }, target, chooser: Chooser::default() }),
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

    fn catch_up(&mut self, ctx: &Context<DeviceFeatures>) -> Result<DeviceRow> {
        // Every token the draft has not seen, the last one (not yet verified) included.
        let hidden = self.model.forward(&ctx.tokens[self.cache.len()..], &mut self.cache)?;
        let last = hidden.dim(0)? - 1;
        Ok(DeviceRow::of(hidden, last))
    }

    fn extend(&mut self, token: u32) -> Result<DeviceRow> {
        Ok(self.model.forward(&[token], &mut self.cache)?.into())
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

/// EAGLE-3 (as `engine::cpu::draft::EagleDraft`): g = fc(the target's streams entering three layers); one midlayer
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

/// The head an EAGLE draft runs.
#[derive(Clone)]
enum Head {
    Eagle(Arc<EagleWeights>),
    Eagle3(Arc<Eagle3Weights>),
}

impl Head {
    /// The one layer, its geometry and its rotary table.
    fn layer(&self) -> (&Layer, &Geometry, &Rope) {
        match self {
            Head::Eagle(w) => (&w.layer, &w.geometry, &w.rope),
            Head::Eagle3(w) => (&w.layer, &w.geometry, &w.rope),
        }
    }

    /// What identifies the weights: drafts on the same ones run together.
    fn weights(&self) -> *const () {
        match self {
            Head::Eagle(w) => Arc::as_ptr(w).cast(),
            Head::Eagle3(w) => Arc::as_ptr(w).cast(),
        }
    }

    /// The stream the layer reads for target positions `start..start + n`: EAGLE-1 the target's post-norm hidden
    /// states, EAGLE-3 fc over its captured layers.
    fn stream(&self, features: &DeviceFeatures, start: usize, n: usize) -> Result<Tensor> {
        match self {
            Head::Eagle(_) => features.hidden_rows(start, n),
            Head::Eagle3(w) => w.fc.forward(&features.layer_rows(start, n)?),
        }
    }

    /// The layer's input and, for EAGLE-3, its attention's input, of stream rows paired with embedded next tokens.
    fn inputs(&self, embedded: &Tensor, streams: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        Ok(match self {
            Head::Eagle(w) => (w.fc.forward(&Tensor::cat(&[embedded, streams], 1)?)?, None),
            Head::Eagle3(w) => {
                let eps = w.geometry.rms_eps as f64;
                let attn_input = Tensor::cat(&[&rms_norm(embedded, &w.input_norm, eps)?, &rms_norm(streams, &w.hidden_norm, eps)?], 1)?;
                (streams.clone(), Some(attn_input))
            }
        })
    }

    /// What the draft LM head reads of the layer's outputs: EAGLE-1 the outputs, EAGLE-3 their final norm.
    fn head_input(&self, outputs: &Tensor) -> Result<Tensor> {
        match self {
            Head::Eagle(_) => Ok(outputs.clone()),
            Head::Eagle3(w) => rms_norm(outputs, &w.norm, w.geometry.rms_eps as f64),
        }
    }
}

/// An EAGLE draft's own part: its head, its cache (a slot of the head's pool) and the layer's output at its last
/// drafted position, the next position's stream in place of a target feature. Drafts on the same weights are fed in
/// one forward (`feed_together`).
pub struct DraftState {
    head: Head,
    cache: Cache,
    last: Option<DeviceRow>,
}

impl SharedWeights for DraftState {
    fn weights(&self) -> *const () {
        self.head.weights()
    }
}

/// Feed drafts on the same weights in one forward of their layer (one pass over its weights, one launch group for
/// all of them): each draft's stream since it last caught up (or its own last output) paired with its next tokens,
/// at its own positions of its own cache. Returns each draft's head input, in order, as rows of one batch.
pub fn feed_together(target: &Llama, states: &mut [&mut DraftState], feeds: &[Feed<'_, DeviceFeatures>]) -> Result<Vec<DeviceRow>> {
    let head = states.first().context("no draft to feed")?.head.clone();
    if states.iter().any(|s| s.head.weights() != head.weights()) {
        bail!("drafts fed together run the same weights");
    }
    let (mut streams, mut lasts, mut tokens, mut rows) = (Vec::with_capacity(states.len()), Vec::new(), Vec::new(), Vec::with_capacity(states.len()));
    for (s, feed) in states.iter_mut().zip(feeds) {
        let seen = s.cache.len();
        let fed = match feed {
            // Draft position j pairs (f_j, t_{j+1}); every j < n − 1 has a true target feature.
            Feed::CatchUp(ctx) => {
                streams.push(head.stream(ctx.features, seen, ctx.tokens.len() - 1 - seen)?);
                &ctx.tokens[seen + 1..]
            }
            // No target feature exists yet for a drafted position: EAGLE feeds its own output instead.
            Feed::Extend(token) => {
                let last = s.last.take().context("extend before catch_up")?;
                streams.push(last.tensor()?);
                lasts.push(last);
                std::slice::from_ref(token)
            }
        };
        tokens.extend_from_slice(fed);
        rows.push(fed.len());
    }
    // Drafts extending together after being fed together: their streams are rows of the last forward's outputs.
    let streams = match lasts.len() == states.len() {
        true => stack(&lasts.iter().collect::<Vec<_>>())?,
        false => Tensor::cat(&streams, 0)?,
    };
    let (x, attn_input) = head.inputs(&target.embed(&tokens)?, &streams)?;
    let (layer, geometry, rope) = head.layer();
    let mut caches: Vec<&mut Cache> = states.iter_mut().map(|s| &mut s.cache).collect();
    let out = Cache::extend(&mut caches, &rows, |buffers, placed| {
        let rope = rope.runs(&placed.runs(), &target.device)?;
        layer.forward_placed(geometry, &rope, &x, attn_input.as_ref(), &buffers[0], placed)
    })?;
    // Every draft's last row, gathered once.
    let ends: Vec<u32> = rows.iter().scan(0, |end, n| {
        *end += n;
        Some(*end as u32 - 1)
    }).collect();
    let last = out.index_select(&Tensor::from_vec(ends, rows.len(), &target.device)?, 0)?;
    let inputs = head.head_input(&last)?;
    let mut fed = Vec::with_capacity(states.len());
    for (i, s) in states.iter_mut().enumerate() {
        s.last = Some(DeviceRow::of(last.clone(), i));
        fed.push(DeviceRow::of(inputs.clone(), i));
    }
    Ok(fed)
}

/// An EAGLE-1 or EAGLE-3 draft on this engine.
pub struct EagleDraft<'a> {
    state: DraftState,
    target: &'a Llama,
    chooser: Chooser<DeviceHead>,
}

impl EagleDraft<'_> {
    fn feed(&mut self, feed: Feed<'_, DeviceFeatures>) -> Result<DeviceRow> {
        Ok(feed_together(self.target, &mut [&mut self.state], &[feed])?.pop().expect("one draft fed"))
    }
}

impl Draft<Llama> for EagleDraft<'_> {
    fn describe(&self) -> String {
        match &self.state.head {
            Head::Eagle(w) => format!("EAGLE-1 head {} (candle)", w.source),
            Head::Eagle3(w) => format!("EAGLE-3 head {} (candle)", w.source),
        }
    }

    fn lm_head(&self) -> LmHead<DeviceHead> {
        match &self.state.head {
            Head::Eagle(_) => LmHead::full(DeviceHead::new(self.target.lm_head().clone())),
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
        self.state.last = None;
    }

    fn catch_up(&mut self, ctx: &Context<DeviceFeatures>) -> Result<DeviceRow> {
        self.feed(Feed::CatchUp(*ctx))
    }

    fn extend(&mut self, token: u32) -> Result<DeviceRow> {
        self.feed(Feed::Extend(token))
    }

    fn rollback(&mut self, before: usize, _accepted: usize) -> Result<()> {
        // Positions computed from the draft's own features are replaced by ones from true target features.
        Positions::truncate(&mut self.state.cache, before - 1)
    }

    fn chooser(&mut self) -> &mut Chooser<DeviceHead> {
        &mut self.chooser
    }

    fn state(&mut self) -> Option<&mut DraftState> {
        Some(&mut self.state)
    }
}
