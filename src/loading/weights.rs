//! Reading weights from GGUF files and from (sharded) HF safetensors into `Matrix` rows.
//!
//! Both sources answer by canonical (GGUF-style) tensor names, so the model is built by one function.

use crate::engine::cpu::kquants;
use crate::engine::cpu::tensor::{BlockQ4_0, BlockQ4_1, BlockQ8_0, Matrix, Storage, QK};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use half::f16;
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// A file of named tensors.
pub trait WeightSource {
    fn path(&self) -> &Path;
    fn contains(&self, name: &str) -> bool;
    /// A 2-D tensor as `[rows, cols]`.
    fn matrix(&self, name: &str) -> Result<Matrix>;
    /// Any tensor, flattened to f32.
    fn vector(&self, name: &str) -> Result<Vec<f32>>;
}

pub struct Gguf {
    path: PathBuf,
    pub content: Content,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf> {
        let mut file = File::open(path).with_context(|| format!("cannot open model file {}", path.display()))?;
        if declared_alignment(&mut file).map_err(|e| anyhow!("{} is not a readable GGUF file: {e}", path.display()))? == Some(0) {
            bail!("{}: general.alignment is 0", path.display());
        }
        file.seek(SeekFrom::Start(0))?;
        let content = Content::read(&mut file)
            .map_err(|e| anyhow!("{} is not a readable GGUF file: {e}", path.display()))?;
        let gguf = Gguf { path: path.to_path_buf(), content };
        gguf.check_tensor_bounds(&mut file)?;
        Ok(gguf)
    }

    /// A truncated download must fail at load with the file named, not later inside a matmul.
    fn check_tensor_bounds(&self, file: &mut File) -> Result<()> {
        let size = file.seek(SeekFrom::End(0))?;
        for (name, info) in &self.content.tensor_infos {
            // Shapes and offsets come from the file: a product or sum that wraps would pass the check below.
            let elems = info.shape.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let dtype = info.ggml_dtype;
            let bytes = elems.filter(|n| n % dtype.block_size() == 0).and_then(|n| (n / dtype.block_size()).checked_mul(dtype.type_size()));
            // Dequantized, a tensor takes 4 bytes a value; that product must not wrap either.
            let bytes = bytes.filter(|_| elems.is_some_and(|n| n.checked_mul(4).is_some())).map(|b| b as u64);
            let end = bytes.and_then(|b| self.content.tensor_data_offset.checked_add(info.offset)?.checked_add(b));
            let Some(end) = end else {
                bail!("{}: tensor {name} has an impossible shape {:?} or offset {}", self.path.display(), info.shape.dims(), info.offset);
            };
            if end > size {
                bail!(
                    "{} is truncated: tensor {name} ends at byte {end} but the file has {size} bytes",
                    self.path.display()
                );
            }
        }
        Ok(())
    }

    pub fn path_display(&self) -> String {
        self.path.display().to_string()
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)
            .ok_or_else(|| anyhow!("{}: metadata key {key} is missing", self.path.display()))?
            .to_string()
            .map(|s| s.as_str())
            .map_err(|e| anyhow!("{}: metadata key {key}: {e}", self.path.display()))
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32> {
        let v = self.meta(key).ok_or_else(|| anyhow!("{}: metadata key {key} is missing", self.path.display()))?;
        let wide = v.to_u32().map(i128::from).or_else(|_| v.to_u64().map(i128::from)).or_else(|_| v.to_i32().map(i128::from));
        let wide = wide.map_err(|e| anyhow!("{}: metadata key {key}: {e}", self.path.display()))?;
        u32::try_from(wide).map_err(|_| anyhow!("{}: metadata key {key} is {wide}, out of range", self.path.display()))
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32> {
        let v = self.meta(key).ok_or_else(|| anyhow!("{}: metadata key {key} is missing", self.path.display()))?;
        v.to_f32().or_else(|_| v.to_f64().map(|x| x as f32)).map_err(|e| anyhow!("{}: metadata key {key}: {e}", self.path.display()))
    }

    /// Tensor `name`'s bytes read straight into values of `B` (`byte_len` bytes): loading never holds a tensor twice
    /// (an 8B model's Q6_K embedding is ≈ 430 MB).
    fn read<B: FileValue>(&self, name: &str, info: &candle_core::quantized::gguf_file::TensorInfo) -> Result<Vec<B>> {
        let len = byte_len(info.ggml_dtype, info.shape.elem_count());
        let size = std::mem::size_of::<B>();
        if len % size != 0 {
            bail!("{}: tensor {name} ({:?}) is not a whole number of its {size}-byte blocks", self.path.display(), info.ggml_dtype);
        }
        // SAFETY: FileValue types are plain old data for which the all-zero pattern is a valid value.
        let mut values: Vec<B> = vec![unsafe { std::mem::zeroed() }; len / size];
        // SAFETY: the vector's len / size values occupy exactly len initialized bytes, and any bytes make valid
        // values of B (FileValue), so writing them through a byte view is sound.
        let bytes = unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, len) };
        let mut file = File::open(&self.path).with_context(|| format!("cannot open {}", self.path.display()))?;
        file.seek(SeekFrom::Start(self.content.tensor_data_offset + info.offset))?;
        file.read_exact(bytes).with_context(|| format!("{}: reading tensor {name}", self.path.display()))?;
        Ok(values)
    }
}

/// A value stored in GGUF tensor data as it lies in memory here: its bytes, little-endian, with no padding, and any bit
/// pattern (all zeros included) a valid value.
///
/// # Safety
/// Implement only for types made of f32, f16, u8 and i8 fields in `repr(C)` without padding.
unsafe trait FileValue: Copy {}
// SAFETY: each is f32 or f16, or a repr(C) struct of f16s and u8/i8 arrays whose size is the sum of its fields' (ggml's
// block sizes 18, 20, 34, 144, 176, 210).
unsafe impl FileValue for f32 {}
unsafe impl FileValue for f16 {}
unsafe impl FileValue for BlockQ4_0 {}
unsafe impl FileValue for BlockQ4_1 {}
unsafe impl FileValue for BlockQ8_0 {}
unsafe impl FileValue for kquants::BlockQ4K {}
unsafe impl FileValue for kquants::BlockQ5K {}
unsafe impl FileValue for kquants::BlockQ6K {}
// GGUF data is little-endian and read as it lies.
const _: () = assert!(cfg!(target_endian = "little"), "frspec reads GGUF tensors in place: little-endian hosts only");

/// The `general.alignment` a GGUF header declares, read before candle's reader, which divides by it unchecked.
/// Walks the metadata as the format lays it out (v1 counts and lengths are u32, later ones u64), bounded by the
/// file's length; candle reads the header again and checks the rest.
fn declared_alignment(file: &mut File) -> Result<Option<u64>> {
    let size = file.seek(SeekFrom::End(0))?;
    let mut r = std::io::BufReader::new(&mut *file);
    r.seek(SeekFrom::Start(0))?;
    let (magic, version) = (le(&mut r, 4)?, le(&mut r, 4)?);
    if magic != 0x4655_4747 {
        return Ok(None);
    }
    let count = if version == 1 { 4 } else { 8 };
    let _tensors = le(&mut r, count)?;
    let entries = le(&mut r, count)?;
    for _ in 0..entries {
        let len = le(&mut r, count)?;
        if len > size {
            bail!("a metadata key of {len} bytes in a file of {size}");
        }
        let mut key = vec![0u8; len as usize];
        r.read_exact(&mut key).context("the header ends early")?;
        let kind = le(&mut r, 4)?;
        if key == b"general.alignment" {
            let width = match kind {
                0 | 1 => 1,
                2 | 3 => 2,
                4 | 5 => 4,
                _ => return Ok(None),
            };
            return Ok(Some(le(&mut r, width)?));
        }
        skip_value(&mut r, kind, count, size, 0)?;
    }
    Ok(None)
}

/// An `n`-byte little-endian unsigned integer (n ≤ 8).
fn le(r: &mut impl Read, n: usize) -> Result<u64> {
    let mut word = [0u8; 8];
    r.read_exact(&mut word[..n]).context("the header ends early")?;
    Ok(u64::from_le_bytes(word))
}

fn skip_value(r: &mut std::io::BufReader<&mut File>, kind: u64, count: usize, size: u64, depth: usize) -> Result<()> {
    let fixed = |kind: u64| match kind {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    };
    let skip = |r: &mut std::io::BufReader<&mut File>, n: u64| -> Result<()> {
        let n = i64::try_from(n).ok().filter(|&n| (n as u64) <= size).ok_or_else(|| anyhow!("a value of {n} bytes in a file of {size}"))?;
        r.seek_relative(n)?;
        Ok(())
    };
    match (kind, fixed(kind)) {
        (_, Some(width)) => skip(r, width),
        (8, _) => {
            let len = le(r, count)?;
            skip(r, len)
        }
        (9, _) if depth < 4 => {
            let inner = le(r, 4)?;
            let n = le(r, count)?;
            match fixed(inner) {
                Some(width) => skip(r, n.checked_mul(width).unwrap_or(u64::MAX)),
                None if n > size => bail!("an array of {n} values in a file of {size}"),
                None => (0..n).try_for_each(|_| skip_value(r, inner, count, size, depth + 1)),
            }
        }
        _ => bail!("metadata value type {kind} is not one GGUF defines"),
    }
}

/// One line per ggml type, the first time a model holds it, for types without a kernel of ours.
fn note_f32_speed(dtype: GgmlDType) {
    static NOTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let name = format!("{dtype:?}");
    let mut noted = NOTED.lock().unwrap_or_else(|e| e.into_inner());
    if !noted.contains(&name) {
        eprintln!("note: {name} weights have no kernel in frspec's CPU engine: dequantized, they run at f32 speed and take 4 bytes a value");
        noted.push(name);
    }
}

fn byte_len(dtype: GgmlDType, elems: usize) -> usize {
    elems / dtype.block_size() * dtype.type_size()
}

impl WeightSource for Gguf {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.path.display()))?;
        let [rows, cols] = info.shape.dims()[..] else {
            bail!("{}: tensor {name} has shape {:?}, expected 2 dimensions", self.path.display(), info.shape.dims())
        };
        let storage = match info.ggml_dtype {
            GgmlDType::F32 => Storage::F32(self.read(name, info)?),
            GgmlDType::F16 => Storage::F16(self.read(name, info)?),
            GgmlDType::Q4_0 => Storage::Q4_0(self.read(name, info)?),
            GgmlDType::Q4_1 => Storage::q4_1(self.read(name, info)?, cols),
            GgmlDType::Q8_0 => Storage::q8_0(self.read(name, info)?, cols),
            GgmlDType::Q4K => Storage::Q4K(self.read(name, info)?),
            GgmlDType::Q5K => Storage::Q5K(self.read(name, info)?),
            GgmlDType::Q6K => Storage::Q6K(self.read(name, info)?),
            // Other ggml types have no kernel of ours: dequantize once with candle and run them as f32.
            other => {
                note_f32_speed(other);
                Storage::F32(self.vector(name)?)
            }
        };
        let block = match storage {
            Storage::Q4_0(_) | Storage::Q4_1(_) | Storage::Q8_0(_) | Storage::Q4_1Interleaved(_) | Storage::Q8_0Interleaved(_) => QK,
            Storage::Q4K(_) | Storage::Q5K(_) | Storage::Q6K(_) => kquants::QK_K,
            Storage::F32(_) | Storage::F16(_) => 1,
        };
        if cols % block != 0 {
            bail!("{}: tensor {name} has {cols} columns, not a multiple of the block size {block}", self.path.display());
        }
        Ok(Matrix { rows, cols, storage })
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.path.display()))?;
        let mut file = File::open(&self.path)?;
        let mut read = || -> candle_core::Result<Vec<f32>> {
            info.read(&mut file, self.content.tensor_data_offset, &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()
        };
        read().map_err(|e| anyhow!("{}: tensor {name} ({:?}): {e}", self.path.display(), info.ggml_dtype))
    }
}

/// One `model.safetensors` or the shards listed by `model.safetensors.index.json`.
pub struct Safetensors {
    path: PathBuf,
    tensors: candle_core::safetensors::MmapedSafetensors,
    names: HashMap<String, ()>,
}

impl Safetensors {
    /// `path` is a `.safetensors` file or a model folder.
    pub fn open(path: &Path) -> Result<Safetensors> {
        let files = safetensors_files(path)?;
        // SAFETY: the files are mapped read-only; frspec never writes to model files while they are in use.
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| anyhow!("{} is not a readable safetensors model: {e}", path.display()))?;
        let names = tensors.tensors().into_iter().map(|(n, _)| (n, ())).collect();
        Ok(Safetensors { path: path.to_path_buf(), tensors, names })
    }

    fn load(&self, name: &str) -> Result<candle_core::Tensor> {
        let hf = hf_name(name);
        self.tensors
            .load(&hf, &Device::Cpu)
            .map_err(|e| anyhow!("{}: tensor {hf}: {e}", self.path.display()))
    }
}

/// Weights are f16, bf16, f32 or f64: integer tensors are not weights, and 8-bit or smaller floats would need the
/// scales a quantized checkpoint keeps beside them (read as they are, the numbers would be wrong).
pub fn float_weights(t: &candle_core::Tensor, path: &Path, name: &str) -> Result<()> {
    match t.dtype() {
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Ok(()),
        other => bail!("{}: tensor {name} has dtype {other:?}; frspec reads f32, f16 and bf16 weights", path.display()),
    }
}

/// A 2-D float tensor (`name` in `path`) as a CPU matrix: f16 weights stay f16 (half the memory and the bytes a
/// product reads; the f16 kernel widens each weight exactly and sums as the f32 one), every other float becomes f32.
pub fn matrix_of(t: &candle_core::Tensor, path: &Path, name: &str) -> Result<Matrix> {
    let &[rows, cols] = t.dims() else {
        bail!("{}: tensor {name} has shape {:?}, expected 2 dimensions", path.display(), t.dims())
    };
    let flat = t.flatten_all()?;
    let storage = match t.dtype() {
        DType::F16 => Storage::F16(flat.to_vec1::<f16>()?),
        _ => Storage::F32(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?),
    };
    Ok(Matrix { rows, cols, storage })
}

/// The shard list of a model folder (index file) or a single file.
pub fn safetensors_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let index = path.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| anyhow!("{}: no weight_map object", index.display()))?;
        let mut shards = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| Ok(path.join(super::RepoPath::new(f).with_context(|| index.display().to_string())?.as_str())))
            .collect::<Result<Vec<PathBuf>>>()?;
        shards.sort();
        shards.dedup();
        if let Some(missing) = shards.iter().find(|s| !s.is_file()) {
            bail!("{} names shard {} which does not exist", index.display(), missing.display());
        }
        return Ok(shards);
    }
    let single = path.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    bail!("{}: no model.safetensors or model.safetensors.index.json", path.display())
}

/// HF Llama tensor names for the canonical GGUF-style names used by the model builder.
pub fn hf_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("blk.") {
        let (layer, part) = rest.split_once('.').unwrap_or((rest, ""));
        let part = match part {
            "attn_norm.weight" => "input_layernorm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "attn_q.bias" => "self_attn.q_proj.bias",
            "attn_k.bias" => "self_attn.k_proj.bias",
            "attn_v.bias" => "self_attn.v_proj.bias",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            other => other,
        };
        return format!("model.layers.{layer}.{part}");
    }
    match name {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        other => other.into(),
    }
}

impl WeightSource for Safetensors {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains_key(&hf_name(name))
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let t = self.load(name)?;
        float_weights(&t, &self.path, &hf_name(name))?;
        matrix_of(&t, &self.path, &hf_name(name))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.load(name)?;
        float_weights(&t, &self.path, &hf_name(name))?;
        Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}
