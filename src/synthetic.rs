//! Small synthetic Llama models with deterministic random weights, written as a real HF model folder
//! (config.json, model.safetensors, tokenizer.json, tokenizer_config.json). Tests and shape-only benchmarks
//! use them; the weights come from a ChaCha stream because candle's CPU `randn` is not reproducible.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub tied: bool,
    pub qkv_bias: bool,
}

impl Shape {
    /// A model small enough to check against a naive reference in milliseconds.
    pub fn tiny() -> Shape {
        Shape { hidden: 64, intermediate: 96, layers: 2, heads: 4, kv_heads: 2, vocab: 260, tied: false, qkv_bias: false }
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// HF-named f32 weights `name → (shape, values)`, deterministic in `seed`.
pub fn weights(shape: &Shape, seed: u64) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = BTreeMap::new();
    let (h, d) = (shape.hidden, shape.head_dim());
    let mut add = |name: String, dims: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = dims.iter().product();
        let values = (0..n).map(|_| offset + scale * rng.random_range(-1.0f32..1.0)).collect();
        out.insert(name, (dims, values));
    };
    add("model.embed_tokens.weight".into(), vec![shape.vocab, h], 1.0, 0.0);
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        let lin = 1.0 / (h as f32).sqrt();
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0);
        add(format!("{p}.self_attn.q_proj.weight"), vec![shape.heads * d, h], lin, 0.0);
        add(format!("{p}.self_attn.k_proj.weight"), vec![shape.kv_heads * d, h], lin, 0.0);
        add(format!("{p}.self_attn.v_proj.weight"), vec![shape.kv_heads * d, h], lin, 0.0);
        if shape.qkv_bias {
            add(format!("{p}.self_attn.q_proj.bias"), vec![shape.heads * d], 0.1, 0.0);
            add(format!("{p}.self_attn.k_proj.bias"), vec![shape.kv_heads * d], 0.1, 0.0);
            add(format!("{p}.self_attn.v_proj.bias"), vec![shape.kv_heads * d], 0.1, 0.0);
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, shape.heads * d], lin, 0.0);
        add(format!("{p}.mlp.gate_proj.weight"), vec![shape.intermediate, h], lin, 0.0);
        add(format!("{p}.mlp.up_proj.weight"), vec![shape.intermediate, h], lin, 0.0);
        add(format!("{p}.mlp.down_proj.weight"), vec![h, shape.intermediate], 1.0 / (shape.intermediate as f32).sqrt(), 0.0);
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    if !shape.tied {
        add("lm_head.weight".into(), vec![shape.vocab, h], 1.0 / (h as f32).sqrt(), 0.0);
    }
    out
}

/// Write a complete HF model folder for `shape` with weights stored in `dtype` (f32, f16 or bf16).
pub fn write_model(dir: &Path, shape: &Shape, seed: u64, dtype: DType) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let arch = if shape.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
    let config = json!({
        "architectures": [arch], "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": shape.tied,
        "bos_token_id": 256, "eos_token_id": 257,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let tensors = weights(shape, seed)
        .into_iter()
        .map(|(name, (dims, values))| Ok((name, Tensor::from_vec(values, dims, &Device::Cpu)?.to_dtype(dtype)?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    write_byte_tokenizer(dir)
}

/// A byte-level BPE tokenizer with no merges (one token per byte, ids 0..256) and two ChatML specials
/// (256 `<|im_start|>`, 257 `<|im_end|>`), with a ChatML template.
pub fn write_byte_tokenizer(dir: &Path) -> Result<()> {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0u8..=255).map(|b| (byte_char(b).to_string(), json!(b as u32))).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
        "added_tokens": [special(256, "<|im_start|>"), special(257, "<|im_end|>")],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string(&tokenizer)?)?;
    let template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + \
                    '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let config = json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// GPT-2's byte → printable character map, which byte-level BPE vocabularies are written in.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).expect("valid code point")
}

/// An EAGLE-1 head for a target of `shape`, with random weights and the key names of yuhuili's Llama-3.1 heads
/// (`fc.weight`, `layers.0.self_attn.*`, `layers.0.mlp.*`, `layers.0.post_attention_layernorm.weight`; no
/// input_layernorm, no final norm), plus its config.json.
pub fn write_eagle_head(dir: &Path, shape: &Shape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let one_layer = Shape { layers: 1, tied: true, qkv_bias: false, ..shape.clone() };
    let mut tensors = std::collections::HashMap::new();
    for (name, (dims, values)) in weights(&one_layer, seed) {
        let Some(rest) = name.strip_prefix("model.layers.0.") else { continue };
        if rest == "input_layernorm.weight" {
            continue;
        }
        tensors.insert(format!("layers.0.{rest}"), Tensor::from_vec(values, dims, &Device::Cpu)?);
    }
    let h = shape.hidden;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfc);
    let fc: Vec<f32> = (0..2 * h * h).map(|_| rng.random_range(-1.0f32..1.0) / (2.0 * h as f32).sqrt()).collect();
    tensors.insert("fc.weight".into(), Tensor::from_vec(fc, (h, 2 * h), &Device::Cpu)?);
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "bias": false, "hidden_size": h, "intermediate_size": shape.intermediate,
        "num_hidden_layers": 1, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// Which EAGLE head `write_first_layer_head` builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadKind {
    Eagle1,
    Eagle3,
}

/// An EAGLE head for the model `write_model(_, shape, seed, _)` writes, built from that model's weights so that it
/// drafts roughly what the target's first layer alone would: a random head's drafts are almost never accepted, and
/// records where nothing is accepted agree whatever two engines drafted, so comparing engines needs a head that
/// drafts well.
/// - EAGLE-1: fc passes the next token's embedding and drops the feature; the layer is the target's first (without
///   its input norm, which EAGLE-1 heads do not have), read through the target's own norm and LM head.
/// - EAGLE-3: its residual starts from fc's output, which cannot carry the next token (the streams are the previous
///   position's), so fc is zero and the attention copies the next token's embedding in: every head reads its own
///   slice of the normed embedding as query, key and value (as many key/value heads as query heads), so a position
///   attends to itself, or to the same token elsewhere, which has the same value. Then the first layer's MLP, and
///   the target's final norm and LM head over a draft vocabulary without every seventh id (so d2t's offsets are
///   not all zero).
pub fn write_first_layer_head(dir: &Path, shape: &Shape, seed: u64, kind: HeadKind) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (h, target) = (shape.hidden, weights(shape, seed));
    let layer0 = |name: &str| target[&format!("model.layers.0.{name}")].clone();
    let tensor = |(dims, values): (Vec<usize>, Vec<f32>)| Tensor::from_vec(values, dims, &Device::Cpu);
    let mut tensors = std::collections::HashMap::new();
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"], "bias": false, "hidden_size": h, "intermediate_size": shape.intermediate,
        "num_hidden_layers": 1, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    });
    let own = ["self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"];
    match kind {
        HeadKind::Eagle1 => {
            for name in own.iter().chain(&["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]) {
                tensors.insert(format!("layers.0.{name}"), tensor(layer0(name))?);
            }
            let fc: Vec<f32> = (0..h).flat_map(|r| (0..2 * h).map(move |c| if c == r { 1.0 } else { 0.0 })).collect();
            tensors.insert("fc.weight".into(), tensor((vec![h, 2 * h], fc))?);
        }
        HeadKind::Eagle3 => {
            for name in &own[1..] {
                tensors.insert(format!("midlayer.{name}"), tensor(layer0(name))?);
            }
            // The query scale makes a position's score with itself (|q|² / √d ≈ 4 · 32 / √32 ≈ 23) stand far above
            // its score with another token (≈ N(0, 4)), so the softmax copies.
            let widened = |scale: f32| (0..h).flat_map(|r| (0..2 * h).map(move |c| if c == r { scale } else { 0.0 })).collect::<Vec<_>>();
            tensors.insert("midlayer.self_attn.q_proj.weight".into(), tensor((vec![h, 2 * h], widened(2.0)))?);
            tensors.insert("midlayer.self_attn.k_proj.weight".into(), tensor((vec![h, 2 * h], widened(2.0)))?);
            tensors.insert("midlayer.self_attn.v_proj.weight".into(), tensor((vec![h, 2 * h], widened(1.0)))?);
            let (_, embedding) = &target["model.embed_tokens.weight"];
            let rms = (embedding.iter().map(|v| v * v).sum::<f32>() / embedding.len() as f32).sqrt();
            let o = (0..h).flat_map(|r| (0..h).map(move |c| if c == r { rms } else { 0.0 })).collect();
            tensors.insert("midlayer.self_attn.o_proj.weight".into(), tensor((vec![h, h], o))?);
            tensors.insert("midlayer.input_layernorm.weight".into(), tensor((vec![h], vec![1.0; h]))?);
            tensors.insert("midlayer.hidden_norm.weight".into(), tensor((vec![h], vec![1.0; h]))?);
            tensors.insert("norm.weight".into(), tensor(target["model.norm.weight"].clone())?);
            tensors.insert("fc.weight".into(), tensor((vec![h, 3 * h], vec![0.0; 3 * h * h]))?);
            let ids: Vec<usize> = (0..shape.vocab).filter(|id| id % 7 != 3).collect();
            let (_, head) = &target[if shape.tied { "model.embed_tokens.weight" } else { "lm_head.weight" }];
            let rows = ids.iter().flat_map(|&id| head[id * h..(id + 1) * h].iter().copied()).collect();
            tensors.insert("lm_head.weight".into(), tensor((vec![ids.len(), h], rows))?);
            let d2t: Vec<i64> = ids.iter().enumerate().map(|(d, &t)| t as i64 - d as i64).collect();
            tensors.insert("d2t".into(), Tensor::from_vec(d2t, ids.len(), &Device::Cpu)?);
            config["architectures"] = json!(["LlamaForCausalLMEagle3"]);
            config["draft_vocab_size"] = json!(ids.len());
            config["num_key_value_heads"] = json!(shape.heads);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}
