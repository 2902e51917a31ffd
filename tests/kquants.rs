//! K-quant weights (Q4_K, Q5_K, Q6_K) on the CPU engine with real tensors: SmolLM2's GGUF re-quantized here (no
//! download: candle's port of ggml's quantizer), scored along MT-Bench tokens against its f32-dequantized twin.

mod common;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use frspec::engine::cpu::model::Model;
use std::fs::File;
use std::path::{Path, PathBuf};

/// SmolLM2's GGUF with every matrix whose rows are whole 256-value super-blocks (in SmolLM2 the 30 ffn_down
/// matrices, 1536 columns; hidden 576 is not a multiple of 256, as in llama.cpp's own Q4_K_M of it) re-quantized
/// to `dtype`; with `as_f32`, written instead as the f32 values that quantization gives (the dequantized twin).
fn requantized(dir: &Path, dtype: GgmlDType, as_f32: bool) -> (PathBuf, usize) {
    let source = common::asset("smollm2");
    let mut file = File::open(&source).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::new();
    let mut changed = 0;
    for name in names {
        let q = content.tensor_infos[name].read(&mut file, content.tensor_data_offset, &Device::Cpu).unwrap();
        let dims = q.shape().dims().to_vec();
        let q = if dims.len() == 2 && dims[1] % 256 == 0 {
            changed += 1;
            let k = QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), dtype).unwrap();
            if as_f32 {
                QTensor::quantize(&k.dequantize(&Device::Cpu).unwrap(), GgmlDType::F32).unwrap()
            } else {
                k
            }
        } else {
            q
        };
        tensors.push((name.clone(), q));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.join(format!("{dtype:?}-{}.gguf", if as_f32 { "f32" } else { "k" }));
    gguf_file::write(&mut File::create(&path).unwrap(), &metadata, &tensors).unwrap();
    (path, changed)
}

/// The first turns of the MT-Bench questions, as llama.cpp tokenizes them for SmolLM2, joined: 1 sequence.
fn tokens() -> Vec<u32> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/fixtures/mtbench_smollm2_llamacpp_tokens.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids: Vec<u32> = fixture["questions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| serde_json::from_value::<Vec<u32>>(q["turns"][0].clone()).unwrap())
        .collect();
    ids[..ids.len().min(400)].to_vec()
}

#[test]
fn k_quant_models_score_like_their_dequantized_twins() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens();
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let (k_path, changed) = requantized(dir.path(), dtype, false);
        let (f_path, _) = requantized(dir.path(), dtype, true);
        assert_eq!(changed, 30, "SmolLM2 has 30 ffn_down matrices of 1536 columns");
        let k = frspec::score::score(&Model::load(&k_path).unwrap(), &tokens).unwrap();
        let f = frspec::score::score(&Model::load(&f_path).unwrap(), &tokens).unwrap();
        let agree = k.positions.iter().zip(&f.positions).filter(|(a, b)| a.top1 == b.top1).count();
        let share = agree as f64 / k.positions.len() as f64;
        let worst = k.logits.iter().zip(&f.logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{dtype:?}: top-1 agreement {agree}/{} ({share:.4}), largest logit difference {worst:.2e}", k.positions.len());
        assert!(share >= 0.99, "{dtype:?}: top-1 agrees at {agree} of {} positions", k.positions.len());
        assert!(worst < 1e-2, "{dtype:?}: logits differ by up to {worst}");
    }
}
