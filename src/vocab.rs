//! Token frequencies and the keep sets FR-Spec prunes the draft head to.
//!
//! Sources, all reduced to one ranking (most frequent first; ties by count descending, then id ascending, so every
//! tool that follows the rule gets the same keep set):
//! - frspec's own file: safetensors with `ids` and `counts` plus metadata (tokenizer hash, corpus, token count);
//! - FR-Spec's `freq_{V}.pt`: a torch-saved Python list of ids, most frequent first (no counts);
//! - vLLM's per-token frequency tensor indexed by id (`.pt`, `.safetensors`, `.npy`).

use anyhow::{anyhow, bail, Context, Result};
use candle_core::pickle::Object;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A frequency ranking of token ids.
#[derive(Clone, Debug)]
pub struct Frequencies {
    /// Ids, most frequent first.
    pub ranking: Vec<u32>,
    /// Counts aligned with `ranking`, when the source has them.
    pub counts: Option<Vec<u64>>,
    /// Metadata of frspec's own files (tokenizer hash, corpus, token count, vocab size).
    pub metadata: HashMap<String, String>,
    pub source: PathBuf,
}

/// How many of the ranked ids to keep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KeepRule {
    /// Drop this fraction of the vocabulary: keep the top ⌈(1 − r)·V⌉ ids. r = 0 keeps everything.
    Ratio(f64),
    /// Keep the top k ids.
    Keep(usize),
    /// Keep the smallest top set whose counts reach this share of all counted tokens.
    Mass(f64),
}

impl KeepRule {
    pub fn validate(&self) -> Result<()> {
        match *self {
            KeepRule::Ratio(r) if !(0.0..1.0).contains(&r) => bail!("pruning ratio must be in [0, 1), got {r}"),
            KeepRule::Keep(0) => bail!("--keep must be at least 1"),
            KeepRule::Mass(m) if !(m > 0.0 && m <= 1.0) => bail!("cumulative mass must be in (0, 1], got {m}"),
            _ => Ok(()),
        }
    }
}

/// Ids kept at pruning ratio `r`: ⌈(1 − r)·V⌉ computed in f64, as vLLM computes it in Python (so 0.99 of 1000
/// keeps 11: 1 − 0.99 is 0.010000000000000009).
pub fn kept_for_ratio(r: f64, vocab: usize) -> usize {
    ((1.0 - r) * vocab as f64).ceil() as usize
}

/// The ids a pruned draft head keeps, sorted ascending (so sliced and masked heads visit them in the same order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeepSet {
    pub ids: Vec<u32>,
    pub vocab: usize,
}

impl KeepSet {
    pub fn fraction(&self) -> f64 {
        self.ids.len() as f64 / self.vocab as f64
    }

    pub fn contains(&self, id: u32) -> bool {
        self.ids.binary_search(&id).is_ok()
    }

    /// Position of `id` within the kept ids.
    pub fn index_of(&self, id: u32) -> Option<usize> {
        self.ids.binary_search(&id).ok()
    }
}

/// The file a frequency spec names: a named asset (such as brown-smollm2) or a path.
pub fn freq_path(spec: &str) -> Result<PathBuf> {
    crate::loading::assets::named(spec).unwrap_or_else(|| Ok(PathBuf::from(spec)))
}

impl Frequencies {
    /// A frequency file named by `freq_path`'s rules.
    pub fn open(spec: &str) -> Result<Frequencies> {
        Frequencies::load(&freq_path(spec)?)
    }

    pub fn load(path: &Path) -> Result<Frequencies> {
        if !path.is_file() {
            bail!("frequency file {} does not exist", path.display());
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let f = match ext {
            "safetensors" => load_safetensors(path),
            "pt" | "pth" | "bin" => load_torch(path),
            "npy" => load_npy(path),
            _ => bail!("{}: unknown frequency file type (expected .safetensors, .pt or .npy)", path.display()),
        };
        // Errors from the readers below frspec (candle, npyz) do not know the file's name.
        let f = f.map_err(|e| match format!("{e:#}").contains(&path.display().to_string()) {
            true => e,
            false => e.context(format!("frequency file {}", path.display())),
        })?;
        if f.ranking.is_empty() {
            bail!("{}: the frequency file holds no ids", path.display());
        }
        Ok(f)
    }

    /// From per-id counts (index = id), ranked by count descending then id ascending.
    pub fn from_counts(counts: &[u64], source: &Path) -> Frequencies {
        let mut ranking: Vec<u32> = (0..counts.len() as u32).collect();
        ranking.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        let ranked_counts = ranking.iter().map(|&i| counts[i as usize]).collect();
        Frequencies { ranking, counts: Some(ranked_counts), metadata: HashMap::new(), source: source.to_path_buf() }
    }

    /// Counts of a tokenizer's tokens (index = id) with their provenance in the metadata, as `freq build` and
    /// `freq from-outputs` write them.
    pub fn counted(counts: &[u64], tokenizer: &str, tokenizer_hash: u64, corpus: String, path: &Path) -> Frequencies {
        let mut f = Frequencies::from_counts(counts, path);
        let m = &mut f.metadata;
        m.insert("tokenizer".into(), tokenizer.into());
        m.insert("tokenizer_hash".into(), format!("{tokenizer_hash:016x}"));
        m.insert("vocab".into(), counts.len().to_string());
        m.insert("corpus".into(), corpus);
        m.insert("tokens".into(), counts.iter().sum::<u64>().to_string());
        m.insert("distinct_ids".into(), counts.iter().filter(|&&c| c > 0).count().to_string());
        m.insert("ties".into(), "count descending, then id ascending".into());
        f
    }

    /// The ids to keep for a target vocabulary of `vocab` ids; `always` (end-of-sequence and end-of-turn ids)
    /// are added whatever their rank.
    pub fn keep_set(&self, rule: KeepRule, vocab: usize, always: &[u32]) -> Result<KeepSet> {
        rule.validate()?;
        let src = self.source.display();
        let mut seen = vec![false; vocab];
        for &id in &self.ranking {
            let slot = seen.get_mut(id as usize).ok_or_else(|| {
                anyhow!("{src}: token id {id} is outside the target vocabulary of {vocab}")
            })?;
            if std::mem::replace(slot, true) {
                bail!("{src}: token id {id} appears twice");
            }
        }
        if let Some(size) = self.metadata.get("vocab").and_then(|v| v.parse::<usize>().ok()) {
            if size != vocab {
                bail!("{src} was built for a vocabulary of {size} ids, the target has {vocab}");
            }
        }
        let k = match rule {
            KeepRule::Ratio(r) => kept_for_ratio(r, vocab),
            KeepRule::Keep(k) => k,
            KeepRule::Mass(m) => {
                let counts = self.counts.as_ref().ok_or_else(|| anyhow!("{src} has no counts: use a ratio or --keep"))?;
                let total: u64 = counts.iter().sum();
                let mut acc = 0u64;
                counts.iter().position(|c| {
                    acc += c;
                    acc as f64 >= m * total as f64
                }).map_or(counts.len(), |i| i + 1)
            }
        };
        if k > vocab {
            bail!("cannot keep {k} ids of a vocabulary of {vocab}");
        }
        let mut ids: Vec<u32> = if k == vocab {
            (0..vocab as u32).collect()
        } else if k <= self.ranking.len() {
            self.ranking[..k].to_vec()
        } else {
            bail!("{src} ranks only {} ids, {k} are needed for {rule:?}", self.ranking.len());
        };
        for &a in always {
            if a as usize >= vocab {
                bail!("end-of-turn id {a} is outside the target vocabulary of {vocab}");
            }
            ids.push(a);
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(KeepSet { ids, vocab })
    }

    /// Share of the counted tokens covered by the top `k` ids (None without counts).
    pub fn coverage(&self, k: usize) -> Option<f64> {
        let counts = self.counts.as_ref()?;
        let total: u64 = counts.iter().sum();
        Some(counts.iter().take(k).sum::<u64>() as f64 / total.max(1) as f64)
    }

    /// The share of `other`'s counted tokens whose ids are among this file's first `k`: how much of another text (the
    /// target's own answers, say) a keep set ranked here holds, where `coverage` only says how much of its own corpus.
    /// None when `other` has no counts; an error when the two count different tokenizers' ids.
    pub fn coverage_on(&self, k: usize, other: &Frequencies) -> Result<Option<f64>> {
        for key in ["tokenizer_hash", "vocab"] {
            if let (Some(a), Some(b)) = (self.metadata.get(key), other.metadata.get(key)) {
                if a != b {
                    bail!("{} and {} count different vocabularies ({key} {a} and {b})", self.source.display(), other.source.display());
                }
            }
        }
        let Some(counts) = other.counts.as_ref() else { return Ok(None) };
        let kept: std::collections::HashSet<u32> = self.ranking.iter().take(k).copied().collect();
        let held: u64 = other.ranking.iter().zip(counts).filter(|(id, _)| kept.contains(id)).map(|(_, c)| c).sum();
        Ok(Some(held as f64 / counts.iter().sum::<u64>().max(1) as f64))
    }

    /// Write frspec's own format: safetensors `ids` (i64) and `counts` (i64) in rank order, with metadata.
    pub fn save(&self, path: &Path) -> Result<()> {
        let counts = self.counts.as_ref().ok_or_else(|| anyhow!("only ranked counts can be saved"))?;
        let le_bytes = |v: &mut dyn Iterator<Item = i64>| -> Vec<u8> { v.flat_map(|x| x.to_le_bytes()).collect() };
        let ids = le_bytes(&mut self.ranking.iter().map(|&i| i as i64));
        let cs = le_bytes(&mut counts.iter().map(|&c| c as i64));
        let n = self.ranking.len();
        let view = |bytes| safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![n], bytes);
        let views = vec![("ids", view(&ids[..])?), ("counts", view(&cs[..])?)];
        let mut meta = self.metadata.clone();
        meta.insert("format".into(), "frspec-frequencies-v1".into());
        let bytes = sorted_header(safetensors::tensor::serialize(views, Some(meta))?)?;
        crate::files::write_atomic(path, &bytes)
    }
}

/// The safetensors crate writes the metadata map in hash order, so two saves of the same frequencies differ byte
/// for byte; sweeps identify their inputs by sha256. Re-encode the header with sorted keys (tensor offsets are
/// relative to the data, so only the header changes), padded with spaces to 8 bytes as the format asks.
fn sorted_header(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n])?;
    let mut text = serde_json::to_vec(&header)?;
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}

/// Frequencies from a per-token tensor (index = id). Its length is the vocabulary it was counted for, which
/// `keep_set` then checks against the target's.
fn per_token(t: &Tensor, path: &Path) -> Result<Frequencies> {
    let counts = to_u64_counts(t, path)?;
    let mut f = Frequencies::from_counts(&counts, path);
    f.metadata.insert("vocab".into(), counts.len().to_string());
    Ok(f)
}

fn to_u64_counts(t: &Tensor, path: &Path) -> Result<Vec<u64>> {
    if t.rank() != 1 {
        bail!("{}: a frequency tensor must be 1-D (one count per token id), got shape {:?}", path.display(), t.dims());
    }
    // Only these convert to f64 exactly or at all (candle's 8-bit float conversion never returned).
    if !matches!(t.dtype(), DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 | DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        bail!("{}: frequencies of dtype {:?} are not supported (use an integer or f16/bf16/f32/f64 tensor)", path.display(), t.dtype());
    }
    let v = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    if let Some((i, c)) = v.iter().enumerate().find(|(_, c)| !(c.is_finite() && **c >= 0.0)) {
        bail!("{}: frequency of token {i} is {c}", path.display());
    }
    // Float frequencies keep their order and proportions as integers: probabilities at 1e12, larger values scaled
    // so the largest is 2^53 (f64's last exact integer) rather than saturating u64 and tying at its maximum.
    let exact = 2f64.powi(53);
    let largest = v.iter().fold(0f64, |m, &c| m.max(c));
    let scale = match t.dtype().is_float() {
        true if largest * 1e12 > exact => exact / largest,
        true => 1e12,
        false => 1.0,
    };
    Ok(v.iter().map(|&c| (c * scale).round() as u64).collect())
}

fn load_safetensors(path: &Path) -> Result<Frequencies> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    if let (Some(ids), Some(counts)) = (tensors.get("ids"), tensors.get("counts")) {
        if ids.dtype() != DType::I64 || counts.dtype() != DType::I64 || ids.rank() != 1 || counts.rank() != 1 {
            bail!("{}: `ids` and `counts` must be 1-D i64 tensors, found {:?} {:?} and {:?} {:?}", path.display(), ids.dtype(), ids.dims(), counts.dtype(), counts.dims());
        }
        let ranking = ids.to_vec1::<i64>()?;
        let counts = counts.to_vec1::<i64>()?;
        if ranking.len() != counts.len() {
            bail!("{}: ids and counts differ in length", path.display());
        }
        let ranking = ranking
            .iter()
            .map(|&i| u32::try_from(i).map_err(|_| anyhow!("{}: token id {i} is out of range", path.display())))
            .collect::<Result<Vec<_>>>()?;
        let mut seen = std::collections::HashSet::new();
        if let Some(id) = ranking.iter().find(|&&id| !seen.insert(id)) {
            bail!("{}: token id {id} is listed twice", path.display());
        }
        if counts.windows(2).any(|w| w[0] < w[1]) {
            bail!("{}: counts are not sorted in descending order", path.display());
        }
        if let Some(c) = counts.iter().find(|&&c| c < 0) {
            bail!("{}: a count is negative ({c})", path.display());
        }
        let counts = counts.iter().map(|&c| c as u64).collect();
        return Ok(Frequencies { ranking, counts: Some(counts), metadata, source: path.to_path_buf() });
    }
    let names: Vec<String> = st.names().into_iter().map(String::from).collect();
    match &names[..] {
        [one] => per_token(&tensors[one], path),
        _ => bail!("{}: expected `ids` + `counts` or a single per-token frequency tensor, found {names:?}", path.display()),
    }
}

fn load_npy(path: &Path) -> Result<Frequencies> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    // npyz allocates the header at the length the file declares (u16 in version 1, u32 after) before reading it.
    let declared = match (bytes.get(6), bytes.get(8..12)) {
        (Some(1), Some(len)) => Some(10 + u16::from_le_bytes([len[0], len[1]]) as usize),
        (Some(_), Some(len)) => Some(12 + u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize),
        _ => None,
    };
    if declared.is_some_and(|end| end > bytes.len()) {
        bail!("{}: the .npy header claims more bytes than the file's {}", path.display(), bytes.len());
    }
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| anyhow!("{} is not a .npy file: {e}", path.display()))?;
    let &[n] = npy.shape() else {
        bail!("{}: a frequency array must be 1-D, got shape {:?}", path.display(), npy.shape());
    };
    // npyz allocates for the shape the header declares; the file must hold that many values first.
    let width = match npy.dtype() {
        npyz::DType::Plain(t) => t.num_bytes().unwrap_or(usize::MAX) as u64,
        _ => u64::MAX,
    };
    if n.checked_mul(width).is_none_or(|need| need > bytes.len() as u64) {
        bail!("{}: the header declares {n} values, more than the file's {} bytes hold", path.display(), bytes.len());
    }
    let values: Vec<f64> = match npy.dtype() {
        npyz::DType::Plain(t) if t.type_char() == npyz::TypeChar::Float && t.size_field() == 4 => {
            npy.into_vec::<f32>()?.into_iter().map(f64::from).collect()
        }
        npyz::DType::Plain(t) if t.type_char() == npyz::TypeChar::Float && t.size_field() == 8 => {
            npy.into_vec::<f64>()?
        }
        npyz::DType::Plain(t) if matches!(t.type_char(), npyz::TypeChar::Int | npyz::TypeChar::Uint) => {
            npy.into_vec::<i64>().map_err(|e| anyhow!("{}: {e}", path.display()))?.into_iter().map(|v| v as f64).collect()
        }
        other => bail!("{}: unsupported dtype {other:?} for a frequency array", path.display()),
    };
    let t = Tensor::new(values.as_slice(), &Device::Cpu)?;
    per_token(&t, path)
}

/// A torch `.pt`: either FR-Spec's pickled list of ids or a pickled frequency tensor.
fn load_torch(path: &Path) -> Result<Frequencies> {
    let mut file = crate::loading::pickle::TorchFile::open(path)?;
    if let Object::List(items) = &file.root {
        let ranking = items
            .iter()
            .map(|o| match o {
                Object::Int(i) if *i >= 0 => Ok(*i as u32),
                Object::Long(i) if (0..=u32::MAX as i64).contains(i) => Ok(*i as u32),
                other => Err(anyhow!("{}: expected a list of token ids, found {other:?}", path.display())),
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(Frequencies { ranking, counts: None, metadata: HashMap::new(), source: path.to_path_buf() });
    }
    // torch.save(tensor): the pickle's root is the tensor (a view of a storage that is a file in the archive).
    let root = std::mem::replace(&mut file.root, Object::None);
    let tensor = file.tensor(&root)?.ok_or_else(|| anyhow!("{}: expected a list of ids or a frequency tensor", path.display()))?;
    if tensor.rank() != 1 {
        bail!("{}: a frequency tensor must be 1-D (one count per token id), got shape {:?}", path.display(), tensor.dims());
    }
    per_token(&tensor, path)
}

/// How a corpus file is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CorpusFormat {
    /// Plain text; each line is tokenized on its own.
    Text,
    /// Brown-corpus style `word/TAG` tokens: the tags are stripped, the words of a line joined by spaces.
    Tagged,
    /// A ShareGPT file (the one `train-eagle --sharegpt` reads): the assistant's turns of its complete records, each
    /// one text with its line breaks. Chat answers, code and tables among them: ids that prose corpora rarely count.
    Sharegpt,
}

/// Corpus arguments as files: a folder stands for every file inside it (sorted by name, hidden files skipped).
pub fn corpus_files(corpus: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for c in corpus {
        if c.is_dir() {
            let mut inside: Vec<PathBuf> = std::fs::read_dir(c)
                .with_context(|| format!("cannot read corpus folder {}", c.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
                .collect();
            inside.sort();
            files.extend(inside);
        } else if c.is_file() {
            files.push(c.clone());
        } else {
            bail!("corpus file {} does not exist", c.display());
        }
    }
    Ok(files)
}

/// The lines of a corpus file, as the text to tokenize (for ShareGPT, its answers).
pub fn corpus_lines(path: &Path, format: CorpusFormat) -> Result<Vec<String>> {
    let strip_tags = match format {
        CorpusFormat::Text => false,
        CorpusFormat::Tagged => true,
        CorpusFormat::Sharegpt => {
            let turns = crate::text::sharegpt::read(path)?.conversations.into_iter().flat_map(|c| c.conversations);
            return Ok(turns.filter(|t| t.from == "gpt" && !t.value.trim().is_empty()).map(|t| t.value).collect());
        }
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read corpus file {}", path.display()))?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match strip_tags {
            false => l.to_string(),
            true => l.split_whitespace().map(|w| w.rsplit_once('/').map_or(w, |(word, _)| word)).collect::<Vec<_>>().join(" "),
        })
        .collect())
}

/// Per-id counts of the tokens of `lines` (index = id), counted in parallel.
pub fn count_tokens(tokenizer: &crate::text::tokenizer::Tokenizer, lines: &[String], vocab: usize) -> Result<Vec<u64>> {
    use rayon::prelude::*;
    lines
        .par_chunks(256)
        .map(|chunk| {
            let mut counts = vec![0u64; vocab];
            for line in chunk {
                for id in tokenizer.encode(line)? {
                    *counts.get_mut(id as usize).ok_or_else(|| anyhow!("token id {id} is outside the vocabulary of {vocab}"))? += 1;
                }
            }
            Ok(counts)
        })
        .try_reduce(|| vec![0u64; vocab], |mut a, b| {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            Ok(a)
        })
}
