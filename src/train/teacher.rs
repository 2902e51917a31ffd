//! The teacher data: conversations answered (or read) by the target with its features and the residual streams an
//! EAGLE-3 head reads, their file (written conversation by conversation, read in place from a mapping), and the draft
//! vocabulary counted from them.

use super::saved_whole;
use crate::engine::cpu::model::Model;
use crate::loading::target::Target;
use crate::text::chat::Message;
use crate::vocab::KeepSet;
use anyhow::{anyhow, bail, Context, Result};
use half::f16;
use std::io::Write;
use std::path::Path;

/// One conversation of the teacher data.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub tokens: Vec<u32>,
    /// Tokens of the prompt; the rest is the target's answer.
    pub prompt_len: usize,
    /// Post-norm target features of every token but the last, `[tokens.len() - 1, hidden]`. Held in f16, the
    /// precision they are stored and trained with, since f32 would double a run's memory: EAGLE-3's streams of
    /// 8,800 ShareGPT answers are ≈ 9.6 GB in f16, too much for a 24 GB machine in f32.
    pub features: Halves,
    /// The residual streams entering the target layers an EAGLE-3 head reads, at the same positions,
    /// `[tokens.len() - 1, layers · hidden]`; empty when none were captured (EAGLE-1).
    pub layers: Halves,
}

/// f16 values made in memory, or read in place from a mapped teacher-data file. Loaded teacher data stays in the
/// file, not in memory: a run's data (16 GB for the EAGLE-3 head's sixth stage) then takes page cache the kernel can
/// give back, so a run may hold more than the machine's memory, and a step reads only its batch (a few MB).
#[derive(Clone)]
pub enum Halves {
    Owned(Vec<f16>),
    /// `len` values from byte `start` of a mapping whose f16 data `load_teacher` checked to be aligned.
    Mapped { file: std::sync::Arc<memmap2::Mmap>, start: usize, len: usize },
}

impl std::ops::Deref for Halves {
    type Target = [f16];

    fn deref(&self) -> &[f16] {
        match self {
            Halves::Owned(v) => v,
            Halves::Mapped { file, start, len } => bytemuck::cast_slice(&file[*start..*start + 2 * len]),
        }
    }
}

impl Default for Halves {
    fn default() -> Halves {
        Halves::Owned(Vec::new())
    }
}

impl PartialEq for Halves {
    fn eq(&self, other: &Halves) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Halves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} f16 values", self.len())
    }
}

impl Conversation {
    pub fn features_f32(&self) -> Vec<f32> {
        widened(&self.features)
    }

    pub fn layers_f32(&self) -> Vec<f32> {
        widened(&self.layers)
    }
}

fn widened(x: &[f16]) -> Vec<f32> {
    x.iter().map(|x| x.to_f32()).collect()
}

fn narrowed(x: &[f32]) -> Halves {
    Halves::Owned(x.iter().map(|&x| f16::from_f32(x)).collect())
}

/// Prompts the target answers together, one batched forward a step. A sequence's answer does not depend on the
/// others beside it (bit for bit), so the batch changes only the time: 16, as CPU sweeps batch, answered 48 ShareGPT
/// requests in 86% of the time 8 took and wrote 48 requests of its own in about 90%, with the same bytes
/// (2026-12-03).
pub(super) const ANSWER_BATCH: usize = 16;

/// Let the target answer every prompt greedily, keeping its features and the inputs of the `capture` layers.
pub fn teacher_data(target: &Target, prompts: &[String], max_new_tokens: usize, capture: &[usize], on_done: &mut dyn FnMut(&Conversation)) -> Result<Vec<Conversation>> {
    let chats: Vec<Vec<Message>> = prompts.iter().map(|p| vec![Message::new("user", p)]).collect();
    chat_answers(target, &chats, max_new_tokens, capture, on_done)
}

/// `teacher_data` for chats of several turns, each ending with the request the target answers.
pub fn chat_answers(target: &Target, chats: &[Vec<Message>], max_new_tokens: usize, capture: &[usize], on_done: &mut dyn FnMut(&Conversation)) -> Result<Vec<Conversation>> {
    let tok = &target.tokenizer;
    let mut out = Vec::with_capacity(chats.len());
    for batch in chats.chunks(ANSWER_BATCH) {
        let chats = batch.iter().map(|chat| tok.chat_prompt(chat)).collect::<Result<Vec<_>>>()?;
        for (c, prompt) in crate::speculative::decode::greedy_continuations(&target.model, &tok.stop_ids, &chats, max_new_tokens, capture)?.into_iter().zip(&chats) {
            let conv = Conversation { tokens: c.tokens, prompt_len: prompt.len(), features: narrowed(&c.features.hidden), layers: narrowed(&c.features.layers) };
            on_done(&conv);
            out.push(conv);
        }
    }
    Ok(out)
}

/// Teacher-forced conversations: each prompt in the chat format followed by its answer text (at most
/// `max_answer_tokens` tokens), forwarded once through the target for its features. Several times faster per token
/// than generating, and the answers are varied text rather than the target's own.
pub fn teacher_forced(target: &Target, pairs: &[(String, String)], max_answer_tokens: usize, capture: &[usize], on_done: &mut dyn FnMut(&Conversation)) -> Result<Vec<Conversation>> {
    let tok = &target.tokenizer;
    let mut out = Vec::with_capacity(pairs.len());
    for (prompt, answer) in pairs {
        let mut tokens = tok.chat_prompt(&[Message::new("user", prompt)])?;
        let prompt_len = tokens.len();
        tokens.extend(tok.encode(answer)?.into_iter().take(max_answer_tokens));
        let conv = forced(&target.model, tokens, prompt_len, capture)?;
        on_done(&conv);
        out.push(conv);
    }
    Ok(out)
}

/// The conversation `tokens` (a prompt of `prompt_len` tokens, then its answer) with the target's features and the
/// inputs of the `capture` layers, from one forward. On the target's own greedy answer it equals what `teacher_data`
/// recorded while generating.
pub fn forced(model: &Model, tokens: Vec<u32>, prompt_len: usize, capture: &[usize]) -> Result<Conversation> {
    if prompt_len == 0 || tokens.len() <= prompt_len {
        bail!("a conversation needs a prompt and an answer ({prompt_len} of {} tokens are prompt)", tokens.len());
    }
    let f = model.forward(&tokens, &mut model.new_cache(), &[], capture)?;
    let mut captured = crate::engine::cpu::CpuFeatures::new(model.config.hidden, capture);
    captured.append(&f.hidden, &f.layer_inputs);
    let rows = tokens.len() - 1;
    let features = narrowed(&captured.hidden[..rows * model.config.hidden]);
    let layers = narrowed(&captured.layers[..rows * capture.len() * model.config.hidden]);
    Ok(Conversation { tokens, prompt_len, features, layers })
}

/// Save conversations as one safetensors file (tokens, offsets, prompt lengths, f16 features and streams), written
/// conversation by conversation. safetensors' own writer takes each tensor's bytes as one slice: for EAGLE-3's
/// streams of a large part (6,633 ShareGPT follow-ups: ≈ 10 GB) that copy, beside the conversations, is more than
/// this machine holds.
pub fn save_teacher(path: &Path, convs: &[Conversation], hidden: usize) -> Result<()> {
    let rows: usize = convs.iter().map(|c| c.features.len() / hidden).sum();
    let tokens: usize = convs.iter().map(|c| c.tokens.len()).sum();
    // The i64 tensors first: with the header padded to 8 bytes, every tensor starts aligned to its element, so the
    // f16 ones are read in place (`Halves::Mapped`).
    let mut tensors = vec![
        Streamed::ints("tokens", tokens, || convs.iter().flat_map(|c| c.tokens.iter().map(|&t| t as i64)).collect()),
        Streamed::ints("offsets", convs.len() + 1, || std::iter::once(0).chain(convs.iter().scan(0, |end, c| {
            *end += c.tokens.len() as i64;
            Some(*end)
        })).collect()),
        Streamed::ints("prompt_lens", convs.len(), || convs.iter().map(|c| c.prompt_len as i64).collect()),
        Streamed::halves("features", convs, rows, hidden, |c| &c.features),
    ];
    // Absent when no layers were captured, so EAGLE-1 teacher data stays as it was.
    let streams: usize = convs.iter().map(|c| c.layers.len()).sum();
    if streams > 0 {
        tensors.push(Streamed::halves("layers", convs, rows, streams / rows.max(1), |c| &c.layers));
    }
    let mut header = serde_json::Map::new();
    let mut end = 0;
    for t in &tensors {
        let start = end;
        end += t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
        header.insert(t.name.into(), serde_json::json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [start, end] }));
    }
    let mut header = serde_json::to_vec(&header)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    saved_whole(path, |tmp| {
        let mut w = std::io::BufWriter::new(std::fs::File::create(tmp).with_context(|| format!("cannot write {}", tmp.display()))?);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for t in &tensors {
            (t.write)(&mut w)?;
        }
        let written = w.into_inner().map_err(|e| e.into_error())?.metadata()?.len();
        if written != (8 + header.len() + end) as u64 {
            bail!("{}: wrote {written} bytes where the header promises {}: conversations of uneven widths", tmp.display(), 8 + header.len() + end);
        }
        Ok(())
    })
}

/// A tensor of a file being written, its bytes written from the conversations as it is.
struct Streamed<'a> {
    name: &'static str,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    write: Box<dyn Fn(&mut dyn Write) -> std::io::Result<()> + 'a>,
}

impl<'a> Streamed<'a> {
    fn ints(name: &'static str, len: usize, values: impl Fn() -> Vec<i64> + 'a) -> Streamed<'a> {
        let write = Box::new(move |w: &mut dyn Write| values().iter().try_for_each(|v| w.write_all(&v.to_le_bytes())));
        Streamed { name, dtype: safetensors::Dtype::I64, shape: vec![len], write }
    }

    /// `[rows, width]` of f16 values, each conversation's `part` in turn.
    fn halves(name: &'static str, convs: &'a [Conversation], rows: usize, width: usize, part: fn(&Conversation) -> &[f16]) -> Streamed<'a> {
        let write = Box::new(move |w: &mut dyn Write| {
            for c in convs {
                if cfg!(target_endian = "little") {
                    w.write_all(bytemuck::cast_slice(part(c)))?;
                } else {
                    part(c).iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))?;
                }
            }
            Ok(())
        });
        Streamed { name, dtype: safetensors::Dtype::F16, shape: vec![rows, width], write }
    }
}

/// The conversations of a teacher-data file, their features and streams read in place from a mapping of it.
pub fn load_teacher(path: &Path, hidden: usize) -> Result<Vec<Conversation>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the file is only read while mapped, and teacher data is written whole to a new file and renamed over
    // an old one (`saved_whole`), never changed in place.
    let bytes = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot read {}", path.display()))?);
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", path.display()))?;
    let damaged = |what: String| anyhow!("{}: {what}: the teacher data is damaged", path.display());
    let tensor = |name: &str, dtype: safetensors::Dtype, dims: usize| -> Result<Option<safetensors::tensor::TensorView>> {
        match st.tensor(name) {
            Ok(t) if t.dtype() != dtype || t.shape().len() != dims => Err(damaged(format!("tensor {name} is {:?} {:?}, not {dims}-d {dtype:?}", t.dtype(), t.shape()))),
            Ok(t) => Ok(Some(t)),
            Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
            Err(e) => Err(damaged(format!("tensor {name}: {e}"))),
        }
    };
    let ints = |name: &str| -> Result<Vec<i64>> {
        let t = tensor(name, safetensors::Dtype::I64, 1)?.ok_or_else(|| damaged(format!("no tensor {name}")))?;
        Ok(t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect())
    };
    let (tokens, offsets, prompt_lens) = (ints("tokens")?, ints("offsets")?, ints("prompt_lens")?);
    let features = tensor("features", safetensors::Dtype::F16, 2)?.ok_or_else(|| damaged("no tensor features".into()))?;
    let layers = tensor("layers", safetensors::Dtype::F16, 2)?;
    let rows = features.shape()[0];
    if features.shape()[1] != hidden {
        return Err(damaged(format!("features are {} wide, the target's hidden size is {hidden}", features.shape()[1])));
    }
    if offsets.first() != Some(&0) || offsets.last() != Some(&(tokens.len() as i64)) || offsets.windows(2).any(|w| w[1].checked_sub(w[0]).is_none_or(|n| n < 2)) || prompt_lens.len() + 1 != offsets.len() {
        return Err(damaged("offsets or prompt lengths do not split the tokens into conversations of two tokens or more".into()));
    }
    if rows != tokens.len() + 1 - offsets.len() || layers.as_ref().is_some_and(|l| l.shape()[0] != rows) {
        return Err(damaged(format!("{rows} rows of features for {} tokens in {} conversations", tokens.len(), offsets.len() - 1)));
    }
    if let Some(t) = tokens.iter().find(|&&t| u32::try_from(t).is_err()) {
        return Err(damaged(format!("token {t}")));
    }
    // In place where the file's f16 data lies aligned in a little-endian machine's memory (safetensors aligns each
    // tensor's data to its element size), else copied out.
    let halves = |t: &safetensors::tensor::TensorView, rows: std::ops::Range<usize>| -> Halves {
        let width = 2 * t.shape()[1];
        let data = &t.data()[rows.start * width..rows.end * width];
        if cfg!(target_endian = "little") && bytemuck::try_cast_slice::<u8, f16>(data).is_ok() {
            let start = data.as_ptr() as usize - bytes.as_ptr() as usize;
            return Halves::Mapped { file: bytes.clone(), start, len: data.len() / 2 };
        }
        Halves::Owned(data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect())
    };
    let mut out = Vec::with_capacity(prompt_lens.len());
    let mut row = 0;
    for (w, &prompt_len) in offsets.windows(2).zip(&prompt_lens) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let span = row..row + b - a - 1;
        out.push(Conversation {
            tokens: tokens[a..b].iter().map(|&t| t as u32).collect(),
            prompt_len: usize::try_from(prompt_len).map_err(|_| damaged(format!("prompt length {prompt_len}")))?,
            features: halves(&features, span.clone()),
            layers: layers.as_ref().map(|l| halves(l, span.clone())).unwrap_or_default(),
        });
        row = span.end;
    }
    Ok(out)
}

/// EAGLE-3's draft vocabulary: the `size` ids the target's answers in `data` hold most often (ties to the lower
/// id), in id order, as d2t needs them; when the answers hold fewer distinct ids, the lowest unused ones fill it.
pub fn draft_vocabulary(data: &[Conversation], size: usize, vocab: usize) -> Result<KeepSet> {
    if size == 0 || size > vocab {
        bail!("--draft-vocab must be between 1 and the target's vocabulary of {vocab}, not {size}");
    }
    let mut counts = vec![0u64; vocab];
    for c in data {
        for &t in &c.tokens[c.prompt_len..] {
            counts[t as usize] += 1;
        }
    }
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by_key(|&t| std::cmp::Reverse(counts[t as usize]));
    let mut ids = order[..size].to_vec();
    ids.sort_unstable();
    Ok(KeepSet { ids, vocab })
}
