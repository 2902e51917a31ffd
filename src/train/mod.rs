//! Training an EAGLE-1 or EAGLE-3 head on a frozen target.
//!
//! Data (`requests`, `teacher`): requests in the target's chat format (never the evaluation set) answered by the
//! target itself (greedy), so the head learns the distribution it will draft for. The target's post-norm features
//! along each conversation (and, for EAGLE-3, the residual streams it reads) are the teacher signal, cached once on
//! disk in f16. `run` makes and caches the data, trains and exports, resumably.
//! Objective (EAGLE-1): draft position i sees (f_i, t_{i+1}) and predicts f_{i+1}: smooth-L1 against it (weight 1, a
//! setting), plus 0.1 (a setting) × the cross-entropy of the head's logits through the target's LM head against the
//! target's next-token distribution softmax(LM head · f_{i+1}) — forward KL plus a constant; only positions that
//! predict answer tokens count. EAGLE-3: fc over the captured streams, the head's own norm and LM head over its draft
//! vocabulary (`draft_vocabulary`), no feature term. Optionally (EAGLE-3's training-time test) further draft steps
//! unrolled on the head's own features, step j weighted 0.8^j. Inputs get uniform noise (±0.1), as in EAGLE. AdamW with linear warm-up and
//! cosine decay, gradient norm clipped at 0.5.
//!
//! The forward here is written in candle tensor operations because training needs autograd; the engine's own
//! kernels (model.rs) run the trained head. A test checks the two agree.

use crate::engine::candle::llama::{self, Rope};
use ops::{attention, attention_unrolled, rms_norm};
use crate::engine::cpu::model::{Config, Model};
use crate::files::write_atomic;
use crate::loading::target::Target;
use crate::vocab::KeepSet;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod ops;
mod requests;
mod run;
mod teacher;
pub use requests::{continuations, load_templates, prompts, self_prompts, sharegpt_follow_ups, sharegpt_prompts, WrittenRequests, SHAREGPT_MAX_PROMPT_TOKENS, TEMPLATES};
pub use run::{train_eagle, TrainOptions, Trained};
pub use teacher::{chat_answers, draft_vocabulary, forced, load_teacher, save_teacher, teacher_data, teacher_forced, Conversation, Halves};
use requests::shuffled;

/// Tensors to a safetensors file through a temporary file and a rename, so a reader never sees half of it.
fn save_tensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    saved_whole(path, |tmp| Ok(candle_core::safetensors::save(tensors, tmp)?))
}

/// `write` to a temporary file beside `path`, then renamed to it.
fn saved_whole(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = path.with_extension("partial");
    write(&tmp)?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}


/// Which head is trained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// fc over (embedding, final feature), one decoder layer, the target's LM head.
    #[default]
    Eagle1,
    /// fc over three of the target's residual streams, one layer over (normed embedding, normed input), its own
    /// norm and LM head over a draft vocabulary.
    Eagle3,
}

impl Arch {
    fn is_eagle1(&self) -> bool {
        *self == Arch::Eagle1
    }

    /// The head's trainable tensors, in yuhuili's key names: the nine both share (fc, the layer), in this order, then
    /// EAGLE-3's input norms, final norm and LM head.
    pub fn keys(self) -> &'static [&'static str] {
        const EAGLE1: [&str; 9] = [
            "fc.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.post_attention_layernorm.weight",
            "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight",
        ];
        const EAGLE3: [&str; 13] = [
            "fc.weight",
            "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight",
            "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight",
            "midlayer.mlp.down_proj.weight",
            "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight",
            "norm.weight",
            "lm_head.weight",
        ];
        match self {
            Arch::Eagle1 => &EAGLE1,
            Arch::Eagle3 => &EAGLE3,
        }
    }

    /// The arch whose keys a safetensors file holds.
    fn of(tensors: &HashMap<String, Tensor>) -> Arch {
        if tensors.contains_key(Arch::Eagle3.keys()[1]) {
            Arch::Eagle3
        } else {
            Arch::Eagle1
        }
    }

    /// The target layers whose incoming residual streams the head reads (none for EAGLE-1).
    pub fn capture(self, target: &Config) -> Vec<usize> {
        match self {
            Arch::Eagle1 => Vec::new(),
            Arch::Eagle3 => crate::engine::cpu::draft::eagle3_default_layers(target.layers),
        }
    }

    /// The default weights of the feature regression and of the token term: EAGLE-1's 1 and 0.1; EAGLE-3 has the
    /// token term alone.
    pub fn loss_weights(self) -> (f64, f64) {
        match self {
            Arch::Eagle1 => (1.0, EAGLE_CLASSIFICATION_WEIGHT),
            Arch::Eagle3 => (0.0, 1.0),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Eagle1 => "EAGLE-1",
            Arch::Eagle3 => "EAGLE-3",
        }
    }
}

/// The shape of one head tensor, from the target's dimensions and the rows of the head's vocabulary.
fn head_shape(c: &Config, arch: Arch, key: &str, vocab_rows: usize) -> Vec<usize> {
    let (h, q, kv, i) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.intermediate);
    // EAGLE-3's attention reads (embedding, input) side by side; its fc reads three residual streams.
    let (attn_in, fc_in) = match arch {
        Arch::Eagle1 => (h, 2 * h),
        Arch::Eagle3 => (2 * h, 3 * h),
    };
    let name = key.rsplit_once("self_attn.").or(key.rsplit_once("mlp.")).map_or(key, |(_, k)| k);
    match name {
        "fc.weight" => vec![h, fc_in],
        "q_proj.weight" => vec![q, attn_in],
        "k_proj.weight" | "v_proj.weight" => vec![kv, attn_in],
        "o_proj.weight" => vec![h, q],
        "gate_proj.weight" | "up_proj.weight" => vec![i, h],
        "down_proj.weight" => vec![h, i],
        "lm_head.weight" => vec![vocab_rows, h],
        _ => vec![h],
    }
}

/// Initial weights. EAGLE-1: fc passes the feature half through (identity) and mixes in the embedding lightly, so
/// the head first predicts f_{i+1} ≈ f_i. EAGLE-3: fc passes the highest residual stream through, and the final
/// norm and LM head start as the target's own (its rows of the draft vocabulary), so the head first reads that
/// stream as an early exit of the target. The layer starts small (N(0, 0.02), output projections scaled down).
fn initial(d: &Config, arch: Arch, seed: u64, target_norm: &[f32], target_head: &Tensor) -> Result<Vec<Tensor>> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut normal = |n: usize, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box-Muller from two uniforms.
                let (u1, u2): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random_range(0.0..1.0));
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect()
    };
    let vocab_rows = target_head.dim(0)?;
    let mut out = Vec::new();
    for &key in arch.keys() {
        let shape = head_shape(d, arch, key, vocab_rows);
        let n: usize = shape.iter().product();
        let values = match key {
            "fc.weight" => {
                let (h, width) = (d.hidden, shape[1]);
                let mut w = normal(n, 0.02);
                // The passed-through block is the last h columns: the feature (EAGLE-1), the highest stream (EAGLE-3).
                for r in 0..h {
                    let passed = r * width + width - h;
                    w[passed..passed + h].iter_mut().for_each(|x| *x *= 0.1);
                    w[passed + r] += 1.0;
                }
                w
            }
            "norm.weight" => target_norm.to_vec(),
            "lm_head.weight" => target_head.flatten_all()?.to_vec1::<f32>()?,
            k if k.ends_with("norm.weight") => vec![1.0; n],
            k if k.ends_with("o_proj.weight") || k.ends_with("down_proj.weight") => normal(n, 0.002),
            _ => normal(n, 0.02),
        };
        out.push(Tensor::from_vec(values, shape, &Device::Cpu)?);
    }
    Ok(out)
}

/// The head's weights by role (`Arch::keys` order).
struct Weights<'a> {
    fc: &'a Tensor,
    layer: [&'a Tensor; 8],
    eagle3: Option<Eagle3Weights<'a>>,
}

struct Eagle3Weights<'a> {
    input_norm: &'a Tensor,
    hidden_norm: &'a Tensor,
    norm: &'a Tensor,
    lm_head: &'a Tensor,
}

impl<'a> Weights<'a> {
    fn of(w: &'a [Tensor]) -> Weights<'a> {
        match w {
            [fc, q, k, v, o, post, gate, up, down, rest @ ..] => Weights {
                fc,
                layer: [q, k, v, o, post, gate, up, down],
                eagle3: match rest {
                    [input_norm, hidden_norm, norm, lm_head] => Some(Eagle3Weights { input_norm, hidden_norm, norm, lm_head }),
                    _ => None,
                },
            },
            _ => unreachable!("a head has nine or thirteen tensors"),
        }
    }

    /// What the first pass is fed from the batch's inputs: the features themselves (EAGLE-1), or fc of the
    /// residual streams (EAGLE-3), which later steps replace with the layer's own output.
    fn first_fed(&self, inputs: &Tensor) -> Result<Tensor> {
        Ok(match self.eagle3 {
            None => inputs.clone(),
            Some(_) => inputs.matmul(&self.fc.t()?)?,
        })
    }

    /// The layer's residual input and attention input at rows fed `fed` with next-token embeddings `emb`.
    fn layer_input(&self, emb: &Tensor, fed: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
        Ok(match &self.eagle3 {
            None => {
                let h = Tensor::cat(&[emb, fed], 1)?.matmul(&self.fc.t()?)?;
                (h.clone(), h)
            }
            Some(e) => (fed.clone(), Tensor::cat(&[&rms_norm(emb, e.input_norm, eps)?, &rms_norm(fed, e.hidden_norm, eps)?], 1)?),
        })
    }

    /// What the head's LM head reads from layer outputs: the outputs themselves (EAGLE-1), or their final norm.
    fn head_input(&self, out: &Tensor, eps: f64) -> Result<Tensor> {
        match &self.eagle3 {
            None => Ok(out.clone()),
            Some(e) => rms_norm(out, e.norm, eps),
        }
    }

    /// Logits over the head's vocabulary: through the target's LM head rows `target_head` (EAGLE-1) or the head's
    /// own.
    fn logits(&self, out: &Tensor, target_head: &Tensor, eps: f64) -> Result<Tensor> {
        let input = self.head_input(out, eps)?;
        match &self.eagle3 {
            None => ops::frozen_product(&input, target_head),
            Some(e) => Ok(input.matmul(&e.lm_head.t()?)?),
        }
    }
}

/// The frozen pieces of the target the head trains against.
struct Frozen {
    embedding: Tensor,
    /// The LM-head rows the head may propose: all, or the keep set's. The teacher distribution is taken over the
    /// same rows — the full softmax restricted to them and renormalised is the softmax of their logits — so a pruned
    /// vocabulary also makes every step cheaper.
    head: Tensor,
}

fn dequantized(m: &crate::engine::cpu::tensor::Matrix) -> Result<Tensor> {
    llama::dense(m, &Device::Cpu, DType::F32)
}

/// Keys and values of each sequence of a pass, after RoPE: what later draft positions attend to.
type Keys = Vec<(Tensor, Tensor)>;

/// Which rows of a batch's packed sequences the passes compute. Each sequence's rows before its `start` feed only
/// the first pass's keys and values, which every later row attends to: no loss reads their outputs, directly or
/// through the unrolled steps fed from them. Skipping the rest of the layer there saves what prompts cost (four
/// tenths of the EAGLE-3 head's later stages' rows, seven of ShareGPT follow-ups'); a start of 0 computes all.
struct Packing {
    lens: Vec<usize>,
    starts: Vec<usize>,
    /// The computed rows, as indices into all packed rows.
    computed: Tensor,
}

impl Packing {
    fn new(lens: Vec<usize>, starts: Vec<usize>) -> Result<Packing> {
        let mut computed = Vec::new();
        let mut offset = 0;
        for (&n, &start) in lens.iter().zip(&starts) {
            computed.extend((offset + start..offset + n).map(|r| r as u32));
            offset += n;
        }
        let count = computed.len();
        Ok(Packing { lens, starts, computed: Tensor::from_vec(computed, count, &Device::Cpu)? })
    }

    /// Every row of sequences of `lens` computed.
    fn whole(lens: Vec<usize>) -> Result<Packing> {
        let starts = vec![0; lens.len()];
        Packing::new(lens, starts)
    }

    /// Each sequence's (first computed row, computed rows).
    fn runs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.starts.iter().zip(&self.lens).map(|(&start, &n)| (start, n - start))
    }
}

/// The head's layer outputs at the computed rows of `p` and their keys and values, fed `fed` with next-token
/// embeddings `emb`. The first pass (no `earlier` passes) is fed every row, keeps every row's keys and values, and
/// each computed row attends causally to its own sequence; unrolled step j = `earlier.len()` is fed the computed
/// rows only and attends as the j-th draft of a chain does (`attention_unrolled`).
fn forward(d: &Config, w: &Weights, emb: &Tensor, fed: &Tensor, p: &Packing, earlier: &[Keys]) -> Result<(Tensor, Keys)> {
    let [q, k, v, o, norm, gate, up, down] = w.layer;
    let (h, attn_in) = w.layer_input(emb, fed, d.rms_eps as f64)?;
    let (ks, vs) = (attn_in.matmul(&k.t()?)?, attn_in.matmul(&v.t()?)?);
    let (h, attn_in) = if earlier.is_empty() { (h.index_select(&p.computed, 0)?, attn_in.index_select(&p.computed, 0)?) } else { (h, attn_in) };
    let qs = attn_in.matmul(&q.t()?)?;
    let rope = Rope::halves(d.rope_theta as f64, d.head_dim);
    let mut outs = Vec::with_capacity(p.lens.len());
    let mut keys = Vec::with_capacity(p.lens.len());
    let (mut q_row, mut kv_row) = (0, 0);
    for (s, ((start, m), &n)) in p.runs().zip(&p.lens).enumerate() {
        let heads = |t: &Tensor, from: usize, rows: usize, count: usize| -> Result<Tensor> { Ok(t.narrow(0, from, rows)?.reshape((rows, count, d.head_dim))?.transpose(0, 1)?.contiguous()?) };
        let q_tables = rope.at(start, m, emb.device())?;
        let qh = ops::rope(&q_tables, &heads(&qs, q_row, m, d.heads)?)?;
        let (kh, vh) = if earlier.is_empty() {
            let kv = (ops::rope(&rope.at(0, n, emb.device())?, &heads(&ks, kv_row, n, d.kv_heads)?)?, heads(&vs, kv_row, n, d.kv_heads)?);
            kv_row += n;
            kv
        } else {
            (ops::rope(&q_tables, &heads(&ks, q_row, m, d.kv_heads)?)?, heads(&vs, q_row, m, d.kv_heads)?)
        };
        outs.push(if earlier.is_empty() {
            attention(&qh, &kh, &vh, start)?
        } else {
            attention_unrolled(&qh, start, &earlier.iter().map(|pass| pass[s].clone()).collect::<Vec<_>>(), &kh, &vh)?
        });
        keys.push((kh, vh));
        q_row += m;
    }
    let attn = Tensor::cat(&outs, 0)?;
    let h = (h + attn.matmul(&o.t()?)?)?;
    let x = rms_norm(&h, norm, d.rms_eps as f64)?;
    let act = x.matmul(&gate.t()?)?.silu()?.mul(&x.matmul(&up.t()?)?)?;
    Ok(((h + act.matmul(&down.t()?)?)?, keys))
}

/// Unrolled step j = `earlier.len()` after the first pass, at the computed rows (`first` and `emb` hold theirs):
/// each computed row after the first of its sequence is fed what step j − 1 computed one position earlier (not
/// detached: the chain is trained through, as in EAGLE-3), the first keeps its true input (past a sequence's first
/// row, one that no counted row depends on at this step). Returns the step's outputs and keys.
fn unrolled_step(d: &Config, w: &Weights, emb: &Tensor, first: &Tensor, previous: &Tensor, earlier: &[Keys], p: &Packing) -> Result<(Tensor, Keys)> {
    let rows = first.dims2()?.0;
    let mut index = Vec::with_capacity(rows);
    for (_, m) in p.runs() {
        let start = index.len() as u32;
        index.push(start);
        index.extend((start + 1..start + m as u32).map(|r| rows as u32 + r - 1));
    }
    let pool = Tensor::cat(&[first, previous], 0)?;
    let fed = pool.index_select(&Tensor::from_vec(index, rows, first.device())?, 0)?;
    forward(d, w, emb, &fed, p, earlier)
}

/// The layer outputs at the computed rows of the pass on true inputs (features for EAGLE-1, residual streams for
/// EAGLE-3) and of `steps` unrolled steps after it, in order.
fn passes(d: &Config, w: &Weights, emb: &Tensor, inputs: &Tensor, p: &Packing, steps: usize) -> Result<Vec<Tensor>> {
    let first = w.first_fed(inputs)?;
    let (out, keys) = forward(d, w, emb, &first, p, &[])?;
    let (mut outs, mut earlier) = (vec![out], vec![keys]);
    if steps > 0 {
        let (emb, first) = (emb.index_select(&p.computed, 0)?, first.index_select(&p.computed, 0)?);
        for _ in 0..steps {
            let (next, keys) = unrolled_step(d, w, &emb, &first, outs.last().expect("the first pass"), &earlier, p)?;
            outs.push(next);
            earlier.push(keys);
        }
    }
    Ok(outs)
}

/// What one optimisation step saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StepLog {
    pub step: usize,
    pub loss: f64,
    pub regression: f64,
    /// Cross-entropy against the teacher distribution: `kl` + the teacher's entropy.
    pub classification: f64,
    /// Forward KL from the teacher distribution to the head's.
    #[serde(default)]
    pub kl: f64,
    /// Share of counted positions where the head's argmax equals the target's.
    pub top1: f64,
    /// The same at each unrolled step of the training-time test, fed the head's own features.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unrolled_top1: Vec<f64>,
    pub positions: usize,
    pub lr: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainSettings {
    pub steps: usize,
    pub seed: u64,
    /// Conversations per step.
    pub batch: usize,
    pub lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    pub checkpoint_every: usize,
    /// Weight of the cross-entropy against the target's next-token distribution (forward KL plus a constant). Left
    /// out of a run's identity at EAGLE's 0.1, so folders made before it was a setting still resume; likewise the
    /// settings below at their defaults.
    #[serde(default = "eagle_classification_weight", skip_serializing_if = "is_eagle_classification_weight")]
    pub classification_weight: f64,
    /// Weight of the feature regression (EAGLE-1's 1; EAGLE-3 drops it).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub feature_weight: f64,
    /// Training-time test: draft steps unrolled after the teacher-forced pass, each fed the features the step before
    /// it predicted (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unroll: usize,
    /// Weight of unrolled step j: `unroll_decay^j` (EAGLE-3's 0.8).
    #[serde(default = "eagle3_unroll_decay", skip_serializing_if = "is_eagle3_unroll_decay")]
    pub unroll_decay: f64,
    #[serde(default, skip_serializing_if = "Arch::is_eagle1")]
    pub arch: Arch,
    /// EAGLE-3's draft vocabulary: this many of the ids most frequent in the target's answers (0 for EAGLE-1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub draft_vocab: usize,
}

pub const EAGLE_CLASSIFICATION_WEIGHT: f64 = 0.1;
pub const EAGLE3_UNROLL_DECAY: f64 = 0.8;

fn eagle_classification_weight() -> f64 {
    EAGLE_CLASSIFICATION_WEIGHT
}

fn is_eagle_classification_weight(w: &f64) -> bool {
    *w == EAGLE_CLASSIFICATION_WEIGHT
}

fn one() -> f64 {
    1.0
}

fn is_one(w: &f64) -> bool {
    *w == 1.0
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn eagle3_unroll_decay() -> f64 {
    EAGLE3_UNROLL_DECAY
}

fn is_eagle3_unroll_decay(w: &f64) -> bool {
    *w == EAGLE3_UNROLL_DECAY
}

/// A batch: packed pairs, their sequence lengths, and which rows count with their teacher features.
struct Batch {
    /// Embeddings of t_{i+1}, `[rows, H]`.
    emb: Tensor,
    /// What the head reads of the target at position i: the noisy true features f_i `[rows, H]` (EAGLE-1), or the
    /// residual streams entering its three layers `[rows, 3H]` (EAGLE-3, which trains on them as they are).
    inputs: Tensor,
    packing: Packing,
    /// The counted rows, as indices into the computed rows.
    counted: Tensor,
    /// Each counted row's position in its sequence: unrolled step j counts the rows at j or later.
    positions: Vec<usize>,
    teacher: Tensor,
}

/// The batch of `convs`; its passes compute each sequence's rows from `unroll` before the first counted one.
fn batch(convs: &[&Conversation], frozen: &Frozen, hidden: usize, arch: Arch, unroll: usize, noise: &mut ChaCha20Rng) -> Result<Batch> {
    let (mut inputs, mut next_tokens, mut lens, mut starts, mut counted, mut positions, mut teacher) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut row = 0u32;
    for c in convs {
        // Pairs (f_i, t_{i+1}) for i < n − 1; row i predicts f_{i+1}, known for i < n − 2, and counts when the token
        // it drafts, t_{i+2}, belongs to the answer.
        let pairs = c.tokens.len() - 1;
        match arch {
            Arch::Eagle1 => inputs.extend(c.features.iter().map(|&x| x.to_f32() + noise.random_range(-0.1f32..0.1))),
            Arch::Eagle3 if c.layers.is_empty() => bail!("EAGLE-3 training needs the target's residual streams, and a conversation holds none"),
            Arch::Eagle3 => inputs.extend(c.layers.iter().map(|x| x.to_f32())),
        }
        next_tokens.extend_from_slice(&c.tokens[1..]);
        // Unrolled step j's row i is fed step j − 1's row i − 1: the first counted row's chain starts `unroll` rows
        // before it.
        let start = c.prompt_len.saturating_sub(2 + unroll).min(pairs - 1);
        for i in 0..pairs.saturating_sub(1) {
            if i + 2 >= c.prompt_len {
                counted.push(row + (i - start) as u32);
                positions.push(i);
                teacher.extend(c.features[(i + 1) * hidden..(i + 2) * hidden].iter().map(|x| x.to_f32()));
            }
        }
        lens.push(pairs);
        starts.push(start);
        row += (pairs - start) as u32;
    }
    let dev = Device::Cpu;
    let rows = next_tokens.len();
    let emb = frozen.embedding.index_select(&Tensor::from_vec(next_tokens, rows, &dev)?, 0)?;
    let width = inputs.len() / rows;
    let inputs = Tensor::from_vec(inputs, (rows, width), &dev)?;
    let m = counted.len();
    Ok(Batch {
        emb,
        inputs,
        packing: Packing::new(lens, starts)?,
        counted: Tensor::from_vec(counted, m, &dev)?,
        positions,
        teacher: Tensor::from_vec(teacher, (m, hidden), &dev)?,
    })
}

/// What a pass is scored against at its counted rows: the layer rows, the teacher features, and the teacher
/// distribution over the head's rows of the LM head (its probabilities, each row's entropy and argmax).
///
/// The distribution is exact, not a stored top-k: the features are stored and the LM head is frozen, so
/// softmax(LM head · f_{i+1}) is recomputed at every step for what a top-k cache would have cost on disk.
struct Targets {
    rows: Tensor,
    features: Tensor,
    p: Tensor,
    entropy: Tensor,
    argmax: Tensor,
}

impl Targets {
    fn new(rows: Tensor, features: Tensor, head: &Tensor) -> Result<Targets> {
        let ops::Distributions { p, entropy, argmax } = ops::distributions(&features.matmul(&head.t()?)?)?;
        Ok(Targets { rows, features, p, entropy, argmax })
    }

    /// The targets of the counted rows at sequence position `from` or later.
    fn from_position(&self, positions: &[usize], from: usize) -> Result<Targets> {
        let kept: Vec<u32> = (0..positions.len() as u32).filter(|&i| positions[i as usize] >= from).collect();
        let kept = Tensor::from_vec(kept.clone(), kept.len(), self.rows.device())?;
        let pick = |t: &Tensor| t.index_select(&kept, 0);
        Ok(Targets {
            rows: pick(&self.rows)?,
            features: pick(&self.features)?,
            p: pick(&self.p)?,
            entropy: pick(&self.entropy)?,
            argmax: pick(&self.argmax)?,
        })
    }
}

/// Forward KL from the distribution of `teacher_logits` to that of `logits` (rows of each), averaged over rows.
pub fn kl_divergence(teacher_logits: &Tensor, logits: &Tensor) -> Result<Tensor> {
    let teacher = ops::distributions(teacher_logits)?;
    forward_kl(&ops::soft_cross_entropy(logits, &teacher.p)?.mean_all()?, &teacher.entropy)
}

/// KL(p ‖ q) averaged over rows, from the mean cross-entropy against p and the rows' entropies H(p): the difference.
fn forward_kl(cross_entropy: &Tensor, entropy: &Tensor) -> Result<Tensor> {
    Ok((cross_entropy.detach() - entropy.mean_all()?)?)
}

/// `feature_weight` × smooth-L1 against the teacher features + `classification_weight` × cross-entropy against
/// the teacher distribution, at the counted rows of the layer outputs `out`; also the loss parts and top-1
/// agreement. Cross-entropy and forward KL differ by the teacher's entropy, a constant: the same gradient. An
/// EAGLE-3 head's outputs are not the target's features, so it has no regression term (logged as 0).
fn objective(out: &Tensor, t: &Targets, w: &Weights, frozen: &Frozen, eps: f64, s: &TrainSettings) -> Result<(Tensor, StepLog)> {
    let out = out.index_select(&t.rows, 0)?;
    let regression = if w.eagle3.is_some() {
        Tensor::zeros((), DType::F32, out.device())?
    } else {
        let diff = (&out - &t.features)?.abs()?;
        let small = diff.clamp(0f32, 1f32)?;
        ((small.sqr()? * 0.5)? + (diff - small)?)?.mean_all()?
    };
    let logits = w.logits(&out, &frozen.head, eps)?;
    let classification = ops::soft_cross_entropy(&logits, &t.p)?.mean_all()?;
    let kl = forward_kl(&classification, &t.entropy)?;
    let total = ((&regression * s.feature_weight)? + (&classification * s.classification_weight)?)?;
    let top1 = logits.argmax(1)?.eq(&t.argmax)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()? as f64;
    let scalar = |x: &Tensor| -> Result<f64> { Ok(x.to_scalar::<f32>()? as f64) };
    let log = StepLog { regression: scalar(&regression)?, classification: scalar(&classification)?, kl: scalar(&kl)?, top1, positions: t.rows.dims1()?, ..StepLog::default() };
    Ok((total, log))
}

/// The loss of one batch: the pass on true features, then the training-time test's unrolled steps, step j weighted
/// `unroll_decay^j` and scored on the rows that have a chain j drafts long.
fn loss(d: &Config, w: &[Tensor], frozen: &Frozen, b: &Batch, s: &TrainSettings) -> Result<(Tensor, StepLog)> {
    let (w, eps) = (Weights::of(w), d.rms_eps as f64);
    let t = Targets::new(b.counted.clone(), b.teacher.clone(), &frozen.head)?;
    let outs = passes(d, &w, &b.emb, &b.inputs, &b.packing, s.unroll)?;
    let (mut total, mut log) = objective(&outs[0], &t, &w, frozen, eps, s)?;
    for (j, out) in outs.iter().enumerate().skip(1) {
        let (part, step_log) = objective(out, &t.from_position(&b.positions, j)?, &w, frozen, eps, s)?;
        total = (total + (part * s.unroll_decay.powi(j as i32))?)?;
        log.unrolled_top1.push(step_log.top1);
    }
    log.loss = total.to_scalar::<f32>()? as f64;
    Ok((total, log))
}

/// Weights (in `Arch::keys` order) and AdamW moments.
pub struct State {
    pub step: usize,
    pub arch: Arch,
    pub vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl State {
    fn fresh(arch: Arch, init: Vec<Tensor>) -> Result<State> {
        let m = init.iter().map(|t| t.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        let vars = init.iter().map(Var::from_tensor).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(State { step: 0, arch, vars, v: m.clone(), m })
    }

    fn tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, key) in self.arch.keys().iter().enumerate() {
            out.insert(key.to_string(), self.vars[i].as_tensor().clone());
            out.insert(format!("adam_m.{key}"), self.m[i].clone());
            out.insert(format!("adam_v.{key}"), self.v[i].clone());
        }
        out
    }

    /// A checkpoint: weights, moments and the step, in one file written atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = self.tensors();
        tensors.insert("step".into(), Tensor::new(&[self.step as i64], &Device::Cpu)?);
        save_tensors(&tensors, path)
    }

    pub fn load(path: &Path) -> Result<State> {
        let t = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let get = |k: String| t.get(&k).cloned().ok_or_else(|| anyhow!("{}: no tensor {k}", path.display()));
        let step = get("step".into())?.to_vec1::<i64>()?[0] as usize;
        let arch = Arch::of(&t);
        let mut s = State { step, arch, vars: Vec::new(), m: Vec::new(), v: Vec::new() };
        for key in arch.keys() {
            s.vars.push(Var::from_tensor(&get(key.to_string())?)?);
            s.m.push(get(format!("adam_m.{key}"))?);
            s.v.push(get(format!("adam_v.{key}"))?);
        }
        Ok(s)
    }

    /// An exported head (model.safetensors in `dir`) as weights, in f32.
    pub fn from_head(dir: &Path) -> Result<State> {
        Ok(Head::load(dir)?.state)
    }

    /// Weights equal, bit for bit (moments included).
    pub fn same_as(&self, other: &State) -> Result<bool> {
        let (a, b) = (self.tensors(), other.tensors());
        for (k, x) in &a {
            let y = b.get(k).ok_or_else(|| anyhow!("no {k}"))?;
            if x.flatten_all()?.to_vec1::<f32>()? != y.flatten_all()?.to_vec1::<f32>()? {
                return Ok(false);
            }
        }
        Ok(self.step == other.step && self.arch == other.arch)
    }

    /// One AdamW update (β = 0.9, 0.95; no decay on norm weights) after clipping the gradient norm at 0.5.
    fn update(&mut self, grads: &candle_core::backprop::GradStore, lr: f64, weight_decay: f64) -> Result<()> {
        let (b1, b2, eps) = (0.9f64, 0.95f64, 1e-8);
        let gs: Vec<Tensor> = self.vars.iter().map(|v| grads.get(v).cloned().unwrap_or_else(|| v.zeros_like().expect("zeros"))).collect();
        let norm = gs.iter().map(|g| g.sqr()?.sum_all()?.to_scalar::<f32>().map(|x| x as f64)).sum::<candle_core::Result<f64>>()?.sqrt();
        let scale = if norm > 0.5 { 0.5 / norm } else { 1.0 };
        self.step += 1;
        let t = self.step as i32;
        for (i, g) in gs.iter().enumerate() {
            let decay = if self.arch.keys()[i].ends_with("norm.weight") { 0.0 } else { weight_decay };
            let step = AdamW { b1, b2, eps, lr, decay, scale, t };
            let values = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            let (mut w, mut m, mut v) = (values(self.vars[i].as_tensor())?, values(&self.m[i])?, values(&self.v[i])?);
            adamw(&mut w, &values(g)?, &mut m, &mut v, &step);
            let tensor = |x: Vec<f32>| Tensor::from_vec(x, g.shape(), g.device());
            (self.m[i], self.v[i]) = (tensor(m)?, tensor(v)?);
            self.vars[i].set(&tensor(w)?)?;
        }
        Ok(())
    }
}

/// One AdamW step's constants: moments' β, ε, learning rate, weight decay, the clipping's gradient scale, and the
/// step's number (from 1).
struct AdamW {
    b1: f64,
    b2: f64,
    eps: f64,
    lr: f64,
    decay: f64,
    scale: f64,
    t: i32,
}

/// An AdamW step on one tensor's values in one pass. Written with candle's tensor ops it took seventeen, each a new
/// tensor the size of the weights (19 MB each for EAGLE-3's 8,192-row LM head), about a tenth of a training step.
/// These are those ops' f32 operations in their order — a tensor times an f64 is `x * (f as f32) + 0`, divided by one
/// is times its reciprocal, plus one is `x * 1 + f` — so the weights and moments are the same bits.
fn adamw(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamW) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    let f = |x: f64| x as f32;
    let (scale, b1, b1_rest, b2, b2_rest) = (f(c.scale), f(c.b1), f(1.0 - c.b1), f(c.b2), f(1.0 - c.b2));
    let (m_unbias, v_unbias) = (f(1.0 / (1.0 - c.b1.powi(c.t))), f(1.0 / (1.0 - c.b2.powi(c.t))));
    let (eps, decay, lr) = (f(c.eps), f(c.decay), f(c.lr));
    w.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).for_each(|(((w, g), m), v)| {
        for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = g * scale + 0.0;
            *m = (*m * b1 + 0.0) + (g * b1_rest + 0.0);
            *v = (*v * b2 + 0.0) + (g * g * b2_rest + 0.0);
            let (m_hat, v_hat) = (*m * m_unbias + 0.0, *v * v_unbias + 0.0);
            *w -= (m_hat / (v_hat.sqrt() * 1.0 + eps) + (*w * decay + 0.0)) * lr + 0.0;
        }
    });
}

/// An exported head (model.safetensors in a folder, as `export` writes it, or packed as heads ship,
/// `loading::pack`): its weights in f32 with fresh moments, and an EAGLE-3 head's `d2t`, the draft vocabulary its LM
/// head's rows stand for.
pub struct Head {
    pub state: State,
    pub d2t: Option<Vec<i64>>,
    pub path: PathBuf,
}

impl Head {
    pub fn load(dir: &Path) -> Result<Head> {
        let (path, packed) = (dir.join("model.safetensors"), dir.join(crate::loading::pack::PACKED));
        let (t, path) = if !path.exists() && packed.exists() {
            (Head::unpacked(&packed).with_context(|| format!("cannot read {}", packed.display()))?, packed)
        } else {
            (candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?, path)
        };
        let get = |k: &str| t.get(k).ok_or_else(|| anyhow!("{}: no tensor {k}", path.display()));
        let arch = Arch::of(&t);
        let init = arch.keys().iter().map(|k| get(k)?.to_dtype(DType::F32).map_err(Into::into)).collect::<Result<Vec<_>>>()?;
        let d2t = match arch {
            Arch::Eagle1 => None,
            Arch::Eagle3 => Some(get("d2t")?.to_dtype(DType::I64)?.to_vec1::<i64>()?),
        };
        Ok(Head { state: State::fresh(arch, init)?, d2t, path })
    }

    /// A packed head's tensors, its Q8_0 matrices dequantized (so training on from a shipped head starts from its
    /// rounded weights) and d2t, which the GGUF holds in f32, back in i64.
    fn unpacked(path: &Path) -> Result<HashMap<String, Tensor>> {
        let mut file = std::fs::File::open(path)?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
        let mut tensors = HashMap::new();
        for name in content.tensor_infos.keys() {
            let t = content.tensor(&mut file, name, &Device::Cpu)?.dequantize(&Device::Cpu)?;
            let t = if name == "d2t" { t.to_dtype(DType::I64)? } else { t };
            tensors.insert(name.clone(), t);
        }
        Ok(tensors)
    }
}

/// Whether a checkpoint is written after `step` steps.
fn checkpoint_due(step: usize, s: &TrainSettings) -> bool {
    step % s.checkpoint_every == 0 || step == s.steps
}

fn learning_rate(s: &TrainSettings, step: usize) -> f64 {
    if step < s.warmup {
        return s.lr * (step + 1) as f64 / s.warmup as f64;
    }
    let progress = (step - s.warmup) as f64 / (s.steps - s.warmup).max(1) as f64;
    s.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// The conversations step `step` trains on: a seeded permutation per epoch, `batch` at a time.
fn step_conversations(n: usize, batch: usize, seed: u64, step: usize) -> Vec<usize> {
    let epoch_order = |epoch: usize| {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        rng.set_stream(epoch as u64);
        shuffled(n, &mut rng)
    };
    let mut current: Option<(usize, Vec<usize>)> = None;
    (step * batch..(step + 1) * batch)
        .map(|g| {
            let (epoch, pos) = (g / n, g % n);
            if current.as_ref().is_none_or(|(e, _)| *e != epoch) {
                current = Some((epoch, epoch_order(epoch)));
            }
            current.as_ref().expect("set above").1[pos]
        })
        .collect()
}

/// Everything a training run needs besides its folder.
pub struct Trainer<'a> {
    pub target: &'a Target,
    pub data: &'a [Conversation],
    /// The ids the head may propose: a keep set (EAGLE-1), or EAGLE-3's draft vocabulary; all when absent.
    pub keep: Option<&'a KeepSet>,
    pub settings: TrainSettings,
}

impl Trainer<'_> {
    fn frozen(&self) -> Result<Frozen> {
        let m = &self.target.model;
        let lm_head = dequantized(m.lm_head())?;
        let head = match self.keep {
            Some(k) => lm_head.index_select(&Tensor::from_vec(k.ids.clone(), k.ids.len(), &Device::Cpu)?, 0)?,
            None => lm_head,
        };
        Ok(Frozen { embedding: dequantized(m.embedding())?, head })
    }

    /// A fresh state (step 0).
    pub fn start(&self) -> Result<State> {
        let (m, arch) = (&self.target.model, self.settings.arch);
        State::fresh(arch, initial(&m.config, arch, self.settings.seed, m.norm(), &self.frozen()?.head)?)
    }

    /// Train from `state` until `until` steps (at most the settings' steps); `on_step` sees every step's log and
    /// may checkpoint.
    pub fn run(&self, state: &mut State, until: usize, on_step: &mut dyn FnMut(&State, &StepLog) -> Result<()>) -> Result<()> {
        let d = &self.target.model.config;
        let frozen = self.frozen()?;
        let s = &self.settings;
        while state.step < until.min(s.steps) {
            let step = state.step;
            let picked: Vec<&Conversation> = step_conversations(self.data.len(), s.batch, s.seed, step).into_iter().map(|i| &self.data[i]).collect();
            let mut noise = ChaCha20Rng::seed_from_u64(s.seed ^ 0x9e37_79b9_7f4a_7c15);
            noise.set_stream(step as u64);
            let b = batch(&picked, &frozen, d.hidden, s.arch, s.unroll, &mut noise)?;
            let w: Vec<Tensor> = state.vars.iter().map(|v| v.as_tensor().clone()).collect();
            let (total, mut log) = loss(d, &w, &frozen, &b, s)?;
            let grads = total.backward()?;
            let lr = learning_rate(s, step);
            state.update(&grads, lr, s.weight_decay)?;
            log.step = state.step;
            log.lr = lr;
            on_step(state, &log)?;
        }
        Ok(())
    }

    /// The loss of the current weights on `convs`, without updating (for curves and tests).
    pub fn evaluate(&self, state: &State, convs: &[&Conversation]) -> Result<StepLog> {
        let d = &self.target.model.config;
        let frozen = self.frozen()?;
        let mut noise = ChaCha20Rng::seed_from_u64(0);
        let b = batch(convs, &frozen, d.hidden, self.settings.arch, self.settings.unroll, &mut noise)?;
        let w: Vec<Tensor> = state.vars.iter().map(|v| v.as_tensor().clone()).collect();
        Ok(loss(d, &w, &frozen, &b, &self.settings)?.1)
    }
}

/// Write the head in the EAGLE repository's layout: config.json and model.safetensors (f16, yuhuili's keys). An
/// EAGLE-3 head also gets its draft vocabulary (`keep`) as `d2t` (draft id d is target id d + d2t[d]) and `t2d`
/// (which target ids are drafted), and names its target layers in config.json, as vLLM and the engine read them.
pub fn export(dir: &Path, state: &State, target: &Model, keep: Option<&KeepSet>) -> Result<()> {
    let c = &target.config;
    let mut tensors = HashMap::new();
    for (i, key) in state.arch.keys().iter().enumerate() {
        tensors.insert(key.to_string(), state.vars[i].as_tensor().to_dtype(DType::F16)?);
    }
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": false, "hidden_act": "silu",
        "hidden_size": c.hidden, "intermediate_size": c.intermediate, "num_hidden_layers": 1,
        "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab, "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.context_length, "torch_dtype": "float16",
    });
    if state.arch == Arch::Eagle3 {
        let ids: Vec<u32> = keep.map_or_else(|| (0..c.vocab as u32).collect(), |k| k.ids.clone());
        let d2t: Vec<i64> = ids.iter().enumerate().map(|(d, &t)| t as i64 - d as i64).collect();
        let mut t2d = vec![0u8; c.vocab];
        ids.iter().for_each(|&t| t2d[t as usize] = 1);
        tensors.insert("d2t".into(), Tensor::from_vec(d2t, ids.len(), &Device::Cpu)?);
        tensors.insert("t2d".into(), Tensor::from_vec(t2d, c.vocab, &Device::Cpu)?);
        config["architectures"] = serde_json::json!(["LlamaForCausalLMEagle3"]);
        config["draft_vocab_size"] = serde_json::json!(ids.len());
        config["tie_word_embeddings"] = serde_json::json!(false);
        config["eagle_config"] = serde_json::json!({ "eagle_aux_hidden_state_layer_ids": state.arch.capture(c) });
    }
    save_tensors(&tensors, &dir.join("model.safetensors"))?;
    write_atomic(&dir.join("config.json"), serde_json::to_string_pretty(&config)?.as_bytes())
}

/// The head's logits at every draft position of `conv`, teacher-forced: `[tokens - 1, vocab]` over the target's
/// vocabulary (EAGLE-1) or the head's draft vocabulary (EAGLE-3).
pub fn teacher_forced_logits(target: &Model, state: &State, conv: &Conversation) -> Result<Vec<f32>> {
    let (emb, inputs, w) = teacher_forced_inputs(target, state, conv)?;
    let (w, eps) = (Weights::of(&w), target.config.rms_eps as f64);
    let (out, _) = forward(&target.config, &w, &emb, &w.first_fed(&inputs)?, &Packing::whole(vec![conv.tokens.len() - 1])?, &[])?;
    Ok(w.logits(&out, &dequantized(target.lm_head())?, eps)?.flatten_all()?.to_vec1::<f32>()?)
}

/// What the head's LM head reads at the training-time test's unrolled steps 1..=`steps` along `conv` (no noise),
/// `[tokens − 1, hidden]` each: row i of step j is what the (j + 1)-th draft of a step computes after catching up on
/// the true inputs through position i − j.
pub fn unrolled_outputs(target: &Model, state: &State, conv: &Conversation, steps: usize) -> Result<Vec<Vec<f32>>> {
    let (emb, inputs, w) = teacher_forced_inputs(target, state, conv)?;
    let w = Weights::of(&w);
    let outs = passes(&target.config, &w, &emb, &inputs, &Packing::whole(vec![conv.tokens.len() - 1])?, steps)?;
    outs[1..].iter().map(|o| Ok(w.head_input(o, target.config.rms_eps as f64)?.flatten_all()?.to_vec1::<f32>()?)).collect()
}

/// The embeddings of t_{i+1} and what the head reads at i (features f_i, or EAGLE-3's residual streams) along
/// `conv`, and the state's weights.
fn teacher_forced_inputs(target: &Model, state: &State, conv: &Conversation) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
    let n = conv.tokens.len() - 1;
    let embedding = dequantized(target.embedding())?;
    let emb = embedding.index_select(&Tensor::from_vec(conv.tokens[1..].to_vec(), n, &Device::Cpu)?, 0)?;
    let read = if state.arch == Arch::Eagle3 { conv.layers_f32() } else { conv.features_f32() };
    let width = read.len() / n;
    let inputs = Tensor::from_vec(read, (n, width), &Device::Cpu)?;
    Ok((emb, inputs, state.vars.iter().map(|v| v.as_tensor().clone()).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::model::RopeStyle;
    use half::f16;

    fn config() -> Config {
        Config {
            architecture: "llama".into(),
            hidden: 32,
            intermediate: 48,
            layers: 8,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            vocab: 64,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            context_length: 256,
            tied_embeddings: true,
        }
    }

    fn random(rng: &mut ChaCha20Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// Conversations of `(tokens, prompt length)`: prompts shorter than the chain, as long as it and much longer.
    fn conversations(d: &Config, arch: Arch, rng: &mut ChaCha20Rng) -> Vec<Conversation> {
        [(9, 1), (12, 3), (20, 14), (30, 24), (17, 16)]
            .into_iter()
            .map(|(n, prompt_len)| {
                let rows = n - 1;
                let halves = |v: Vec<f32>| Halves::Owned(v.into_iter().map(f16::from_f32).collect());
                let layers = if arch == Arch::Eagle3 { halves(random(rng, rows * 3 * d.hidden, 1.0)) } else { Halves::default() };
                Conversation { tokens: (0..n).map(|_| rng.random_range(0..d.vocab as u32)).collect(), prompt_len, features: halves(random(rng, rows * d.hidden, 1.0)), layers }
            })
            .collect()
    }

    #[test]
    fn adamw_in_one_pass_equals_candles_composed_ops_bit_for_bit() {
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let n = 40_000;
        let tensor = |x: Vec<f32>| Tensor::from_vec(x, n, &Device::Cpu).unwrap();
        let (mut w, g) = (random(&mut rng, n, 1.0), random(&mut rng, n, 3.0));
        let (mut m, mut v) = (random(&mut rng, n, 0.1), random(&mut rng, n, 0.1).into_iter().map(f32::abs).collect::<Vec<_>>());
        for (t, scale, decay) in [(1, 1.0, 0.0), (7, 0.37, 0.01), (300, 0.5, 0.1)] {
            let c = AdamW { b1: 0.9, b2: 0.95, eps: 1e-8, lr: 3e-4, decay, scale, t };
            let (w0, m0, v0) = (tensor(w.clone()), tensor(m.clone()), tensor(v.clone()));
            let g0 = (tensor(g.clone()) * c.scale).unwrap();
            let m1 = ((&m0 * c.b1).unwrap() + (&g0 * (1.0 - c.b1)).unwrap()).unwrap();
            let v1 = ((&v0 * c.b2).unwrap() + (g0.sqr().unwrap() * (1.0 - c.b2)).unwrap()).unwrap();
            let m_hat = (&m1 / (1.0 - c.b1.powi(t))).unwrap();
            let v_hat = (&v1 / (1.0 - c.b2.powi(t))).unwrap();
            let w1 = (&w0 - ((m_hat / (v_hat.sqrt().unwrap() + c.eps).unwrap()).unwrap() + (&w0 * decay).unwrap()).unwrap() * c.lr).unwrap();
            adamw(&mut w, &g, &mut m, &mut v, &c);
            let differing = |x: &[f32], t: &Tensor| x.iter().zip(t.to_vec1::<f32>().unwrap()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differing(&m, &m1), 0, "step {t}: first moments");
            assert_eq!(differing(&v, &v1), 0, "step {t}: second moments");
            assert_eq!(differing(&w, &w1), 0, "step {t}: weights");
        }
    }

    #[test]
    fn skipping_the_rows_before_each_chain_changes_neither_loss_nor_gradients() {
        let d = config();
        for (arch, unroll) in [(Arch::Eagle1, 0), (Arch::Eagle1, 2), (Arch::Eagle3, 2), (Arch::Eagle3, 3)] {
            let mut rng = ChaCha20Rng::seed_from_u64(7);
            let frozen = Frozen {
                embedding: Tensor::from_vec(random(&mut rng, d.vocab * d.hidden, 1.0), (d.vocab, d.hidden), &Device::Cpu).unwrap(),
                head: Tensor::from_vec(random(&mut rng, d.vocab * d.hidden, 1.0), (d.vocab, d.hidden), &Device::Cpu).unwrap(),
            };
            // The initial layer is nearly silent; larger weights make attention matter.
            let weights: Vec<Tensor> = initial(&d, arch, 3, &vec![1.0; d.hidden], &frozen.head)
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(i, w)| if (1..=8).contains(&i) { (w * 10.0).unwrap() } else { w })
                .collect();
            let state = State::fresh(arch, weights).unwrap();
            let (feature_weight, classification_weight) = arch.loss_weights();
            let s = TrainSettings { steps: 1, seed: 0, batch: 5, lr: 1e-3, warmup: 0, weight_decay: 0.0, checkpoint_every: 1, classification_weight, feature_weight, unroll, unroll_decay: EAGLE3_UNROLL_DECAY, arch, draft_vocab: 0 };
            let convs = conversations(&d, arch, &mut rng);
            let picked: Vec<&Conversation> = convs.iter().collect();
            let skipping = batch(&picked, &frozen, d.hidden, arch, unroll, &mut ChaCha20Rng::seed_from_u64(1)).unwrap();
            let every_row = Batch {
                counted: skipping.packing.computed.index_select(&skipping.counted, 0).unwrap(),
                packing: Packing::whole(skipping.packing.lens.clone()).unwrap(),
                emb: skipping.emb.clone(),
                inputs: skipping.inputs.clone(),
                positions: skipping.positions.clone(),
                teacher: skipping.teacher.clone(),
            };
            let rows = |b: &Batch| b.packing.computed.dims1().unwrap();
            assert!(4 * rows(&skipping) < 3 * rows(&every_row), "{arch:?}: {} of {} rows computed", rows(&skipping), rows(&every_row));
            let w: Vec<Tensor> = state.vars.iter().map(|v| v.as_tensor().clone()).collect();
            let (a, log_a) = loss(&d, &w, &frozen, &skipping, &s).unwrap();
            let (b, log_b) = loss(&d, &w, &frozen, &every_row, &s).unwrap();
            assert!((log_a.loss - log_b.loss).abs() <= 1e-5 * log_b.loss.abs(), "{arch:?} unroll {unroll}: loss {} against {}", log_a.loss, log_b.loss);
            assert_eq!((log_a.top1, &log_a.unrolled_top1, log_a.positions), (log_b.top1, &log_b.unrolled_top1, log_b.positions));
            assert_eq!(log_a.unrolled_top1.len(), unroll);
            let (ga, gb) = (a.backward().unwrap(), b.backward().unwrap());
            for (key, v) in arch.keys().iter().zip(&state.vars) {
                let (x, y) = (ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
                let scale = y.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let diff = (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(scale > 0.0 && diff <= 1e-4 * scale, "{arch:?} unroll {unroll}, {key}: gradients differ by {diff} (largest {scale})");
            }
        }
    }
}
