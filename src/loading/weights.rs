//! Reading weights from GGUF files and from (sharded) HF safetensors into `Matrix` rows.
//!
//! Both sources answer by canonical (GGUF-style) tensor names, so the model is built by one function.

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
            let end = self.content.tensor_data_offset + info.offset + byte_len(info.ggml_dtype, info.shape.elem_count()) as u64;
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
        v.to_u32()
            .or_else(|_| v.to_u64().map(|x| x as u32))
            .or_else(|_| v.to_i32().map(|x| x as u32))
            .map_err(|e| anyhow!("{}: metadata key {key}: {e}", self.path.display()))
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32> {
        let v = self.meta(key).ok_or_else(|| anyhow!("{}: metadata key {key} is missing", self.path.display()))?;
        v.to_f32().or_else(|_| v.to_f64().map(|x| x as f32)).map_err(|e| anyhow!("{}: metadata key {key}: {e}", self.path.display()))
    }

    fn raw(&self, name: &str) -> Result<(GgmlDType, Vec<usize>, Vec<u8>)> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.path.display()))?;
        let mut file = File::open(&self.path).with_context(|| format!("cannot open {}", self.path.display()))?;
        let mut bytes = vec![0u8; byte_len(info.ggml_dtype, info.shape.elem_count())];
        file.seek(SeekFrom::Start(self.content.tensor_data_offset + info.offset))?;
        file.read_exact(&mut bytes).with_context(|| format!("{}: reading tensor {name}", self.path.display()))?;
        Ok((info.ggml_dtype, info.shape.dims().to_vec(), bytes))
    }
}

fn byte_len(dtype: GgmlDType, elems: usize) -> usize {
    elems / dtype.block_size() * dtype.type_size()
}

fn f16_at(b: &[u8], i: usize) -> f16 {
    f16::from_le_bytes([b[i], b[i + 1]])
}

impl WeightSource for Gguf {
    fn path(&self) -> &Path {
        &self.path
    }

    fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn matrix(&self, name: &str) -> Result<Matrix> {
        let (dtype, dims, bytes) = self.raw(name)?;
        let [rows, cols] = dims[..] else {
            bail!("{}: tensor {name} has shape {dims:?}, expected 2 dimensions", self.path.display())
        };
        let storage = match dtype {
            GgmlDType::F32 => Storage::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
            GgmlDType::F16 => Storage::F16(bytes.chunks_exact(2).map(|c| f16_at(c, 0)).collect()),
            GgmlDType::Q4_0 => Storage::Q4_0(
                bytes.chunks_exact(18).map(|c| BlockQ4_0 { d: f16_at(c, 0), qs: c[2..18].try_into().unwrap() }).collect(),
            ),
            GgmlDType::Q4_1 => Storage::Q4_1(
                bytes
                    .chunks_exact(20)
                    .map(|c| BlockQ4_1 { d: f16_at(c, 0), m: f16_at(c, 2), qs: c[4..20].try_into().unwrap() })
                    .collect(),
            ),
            GgmlDType::Q8_0 => Storage::Q8_0(
                bytes
                    .chunks_exact(34)
                    .map(|c| BlockQ8_0 { d: f16_at(c, 0), qs: std::array::from_fn(|i| c[2 + i] as i8) })
                    .collect(),
            ),
            // Other ggml types have no kernel of ours: dequantize once with candle and run them as f32.
            _ => Storage::F32(self.vector(name)?),
        };
        if matches!(storage, Storage::Q4_0(_) | Storage::Q4_1(_) | Storage::Q8_0(_)) && cols % QK != 0 {
            bail!("{}: tensor {name} has {cols} columns, not a multiple of the block size {QK}", self.path.display());
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
    /// Keep f16 weights as f16 (half the memory); everything else becomes f32 on CPU.
    keep_f16: bool,
}

impl Safetensors {
    /// `path` is a `.safetensors` file or a model folder.
    pub fn open(path: &Path) -> Result<Safetensors> {
        let files = safetensors_files(path)?;
        // SAFETY: the files are mapped read-only; frspec never writes to model files while they are in use.
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| anyhow!("{} is not a readable safetensors model: {e}", path.display()))?;
        let names = tensors.tensors().into_iter().map(|(n, _)| (n, ())).collect();
        Ok(Safetensors { path: path.to_path_buf(), tensors, names, keep_f16: true })
    }

    fn load(&self, name: &str) -> Result<candle_core::Tensor> {
        let hf = hf_name(name);
        self.tensors
            .load(&hf, &Device::Cpu)
            .map_err(|e| anyhow!("{}: tensor {hf}: {e}", self.path.display()))
    }
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
        let &[rows, cols] = t.dims() else {
            bail!("{}: tensor {} has shape {:?}, expected 2 dimensions", self.path.display(), hf_name(name), t.dims())
        };
        let flat = t.flatten_all()?;
        let storage = match t.dtype() {
            DType::F16 if self.keep_f16 => Storage::F16(flat.to_vec1::<f16>()?),
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Storage::F32(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            other => bail!("{}: tensor {} has dtype {other:?}; frspec reads f32, f16 and bf16 weights", self.path.display(), hf_name(name)),
        };
        Ok(Matrix { rows, cols, storage })
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.load(name)?;
        if !t.dtype().is_float() {
            bail!("{}: tensor {} has dtype {:?}, expected a float type", self.path.display(), hf_name(name), t.dtype());
        }
        Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}
