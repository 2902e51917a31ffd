//! Heads as this repository ships them inside the binary: a head folder's weight matrices in Q8_0, one GGUF file
//! beside its config.json. An EAGLE-3 head's LM head over its own draft vocabulary doubles its size against an
//! EAGLE-1 head's; at f16 both in the tree and in the binary it would not fit what travels to a GPU machine (64 MiB).
//! The engines read the packed folder as they read the exported one (`engine::cpu::draft`).

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// The packed weights file in a head folder.
pub const PACKED: &str = "model.gguf";

/// Write `head`'s config.json and its model.safetensors as `out`/model.gguf: every matrix whose rows are whole Q8_0
/// blocks in Q8_0, the rest (norms, d2t) in f32. vLLM's `t2d` is left out: the engines derive it from `d2t`.
/// Returns the packed file's size in bytes.
pub fn pack(head: &Path, out: &Path) -> Result<u64> {
    let weights = head.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu).map_err(|e| anyhow!("{}: {e}", weights.display()))?;
    let config = std::fs::read(head.join("config.json")).with_context(|| format!("cannot read {}", head.join("config.json").display()))?;
    let mut names: Vec<&String> = tensors.keys().filter(|n| n.as_str() != "t2d").collect();
    // Sorted, so the same head always packs to the same bytes.
    names.sort();
    let packed = names
        .iter()
        .map(|&name| Ok((name.as_str(), packed_tensor(&tensors[name], name).with_context(|| format!("{}: tensor {name}", weights.display()))?)))
        .collect::<Result<Vec<(&str, QTensor)>>>()?;
    // No path or version in it: the bytes depend on the head alone.
    let source = Value::String("frspec pack-head: model.safetensors, matrices in Q8_0".into());
    let mut bytes = std::io::Cursor::new(Vec::new());
    let refs: Vec<(&str, &QTensor)> = packed.iter().map(|(n, t)| (*n, t)).collect();
    candle_core::quantized::gguf_file::write(&mut bytes, &[("general.source", &source)], &refs)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    crate::files::write_atomic(&out.join("config.json"), &config)?;
    crate::files::write_atomic(&out.join(PACKED), bytes.get_ref())?;
    Ok(bytes.get_ref().len() as u64)
}

fn packed_tensor(t: &Tensor, name: &str) -> Result<QTensor> {
    let dtype = match (t.dtype(), t.dims()) {
        (DType::F16 | DType::BF16 | DType::F32, &[_, cols]) if cols % GgmlDType::Q8_0.block_size() == 0 => GgmlDType::Q8_0,
        (DType::F16 | DType::BF16 | DType::F32, _) => GgmlDType::F32,
        // GGUF has no integer tensors; f32 holds every offset of a vocabulary below 2^24 exactly.
        (DType::I64, &[_]) if name == "d2t" => {
            if t.to_vec1::<i64>()?.iter().any(|o| o.unsigned_abs() >= 1 << 24) {
                bail!("d2t offsets beyond 2^24 have no exact f32");
            }
            GgmlDType::F32
        }
        (other, dims) => bail!("{other:?} of shape {dims:?}, not a head's weight (f16, bf16 or f32; d2t i64)"),
    };
    Ok(QTensor::quantize(&t.to_dtype(DType::F32)?, dtype)?)
}
