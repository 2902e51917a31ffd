//! The model against a naive f64 reference on synthetic Llama/Qwen2 weights, in every storage dtype, and the
//! properties speculative decoding relies on: block == single tokens, truncate + re-feed == uninterrupted.

mod common;
use candle_core::DType;
use common::{reference_logits, Weights};
use frspec::engine::cpu::model::{Forward, Model};
use frspec::synthetic::{self, Shape};
use half::{bf16, f16};

const TOKENS: [u32; 12] = [256, 72, 105, 33, 10, 257, 3, 200, 45, 45, 99, 1];

fn load(shape: &Shape, dtype: DType) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), shape, 11, dtype).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

fn all_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let rows: Vec<usize> = (0..tokens.len()).collect();
    model.forward(tokens, &mut model.new_cache(), &rows, &[]).unwrap().logits
}

fn assert_close_to_reference(model: &Model, w: &Weights, shape: &Shape, tol: f64) {
    let ours = all_logits(model, &TOKENS);
    let reference = reference_logits(w, shape, &TOKENS);
    let mut worst = 0f64;
    for (pos, row) in reference.iter().enumerate() {
        for (v, r) in row.iter().enumerate() {
            worst = worst.max((ours[pos * shape.vocab + v] as f64 - r).abs());
        }
    }
    assert!(worst < tol, "max |Δlogit| {worst} against the reference (tolerance {tol})");
}

fn rounded(w: &Weights, round: fn(f32) -> f32) -> Weights {
    w.iter().map(|(k, (s, v))| (k.clone(), (s.clone(), v.iter().map(|x| round(*x)).collect()))).collect()
}

#[test]
fn llama_and_qwen2_shapes_match_the_reference_in_f32() {
    for shape in [Shape::tiny(), Shape { tied: true, ..Shape::tiny() }, Shape { qkv_bias: true, ..Shape::tiny() }] {
        let (_dir, model) = load(&shape, DType::F32);
        assert_close_to_reference(&model, &synthetic::weights(&shape, 11), &shape, 1e-4);
    }
}

#[test]
fn f16_and_bf16_checkpoints_match_the_reference_of_their_rounded_weights() {
    let shape = Shape::tiny();
    let w = synthetic::weights(&shape, 11);
    let (_d, m16) = load(&shape, DType::F16);
    assert_close_to_reference(&m16, &rounded(&w, |x| f16::from_f32(x).to_f32()), &shape, 1e-4);
    let (_d, mbf) = load(&shape, DType::BF16);
    assert_close_to_reference(&mbf, &rounded(&w, |x| bf16::from_f32(x).to_f32()), &shape, 1e-4);
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let shape = Shape::tiny();
    let (single_dir, single) = load(&shape, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let tensors = candle_core::safetensors::load(single_dir.path().join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let (mut a, mut b) = (std::collections::HashMap::new(), std::collections::HashMap::new());
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let shard = if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(name.clone(), shard.into());
        if i % 2 == 0 { a.insert(name, t) } else { b.insert(name, t) };
    }
    candle_core::safetensors::save(&a, dir.path().join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
    std::fs::copy(single_dir.path().join("config.json"), dir.path().join("config.json")).unwrap();
    let sharded = Model::load(dir.path()).unwrap();
    assert_eq!(all_logits(&sharded, &TOKENS), all_logits(&single, &TOKENS));
}

#[test]
fn a_block_equals_its_tokens_one_at_a_time_bit_for_bit() {
    let (_dir, model) = load(&Shape::tiny(), DType::F16);
    let n = TOKENS.len();
    let rows: Vec<usize> = (0..n).collect();
    let block = model.forward(&TOKENS, &mut model.new_cache(), &rows, &[1]).unwrap();
    let mut cache = model.new_cache();
    for (i, t) in TOKENS.iter().enumerate() {
        let one = model.forward(&[*t], &mut cache, &[0], &[1]).unwrap();
        let h = model.config.hidden;
        let v = model.config.vocab;
        assert_eq!(one.hidden, block.hidden[i * h..(i + 1) * h], "hidden state at position {i}");
        assert_eq!(one.logits, block.logits[i * v..(i + 1) * v], "logits at position {i}");
        assert_eq!(one.layer_inputs[0], block.layer_inputs[0][i * h..(i + 1) * h], "layer-1 input at position {i}");
    }
}

#[test]
fn truncating_the_cache_and_refeeding_reproduces_the_uninterrupted_run() {
    let (_dir, model) = load(&Shape::tiny(), DType::F32);
    let all: Vec<usize> = (0..TOKENS.len()).collect();
    let straight = model.forward(&TOKENS, &mut model.new_cache(), &all, &[]).unwrap();
    let mut cache = model.new_cache();
    model.forward(&TOKENS[..8], &mut cache, &[], &[]).unwrap();
    // A rejected speculative tail: different tokens at positions 5..8, then rolled back.
    cache.truncate(5);
    assert_eq!(cache.len(), 5);
    let rest: Vec<usize> = (0..TOKENS.len() - 5).collect();
    let refed = model.forward(&TOKENS[5..], &mut cache, &rest, &[]).unwrap();
    let (h, v) = (model.config.hidden, model.config.vocab);
    assert_eq!(refed.hidden, straight.hidden[5 * h..]);
    assert_eq!(refed.logits, straight.logits[5 * v..]);
}

#[test]
fn layer_zero_input_is_the_embedding_and_logit_rows_are_selectable() {
    let (_dir, model) = load(&Shape::tiny(), DType::F32);
    let out = model.forward(&TOKENS[..4], &mut model.new_cache(), &[3, 1], &[0]).unwrap();
    let mut emb = Vec::new();
    model.embed_into(&TOKENS[..4], &mut emb).unwrap();
    assert_eq!(out.layer_inputs[0], emb);
    let full = all_logits(&model, &TOKENS[..4]);
    let v = model.config.vocab;
    assert_eq!(out.logits[..v], full[3 * v..4 * v]);
    assert_eq!(out.logits[v..], full[v..2 * v]);
}

#[test]
fn a_forward_writing_over_an_earlier_logits_buffer_gives_fresh_logits() {
    let (_dir, model) = load(&Shape::tiny(), DType::F32);
    let fresh = model.forward(&TOKENS[..4], &mut model.new_cache(), &[3, 1], &[]).unwrap();
    // Longer than needed and holding other values, then shorter than needed.
    for stale in [vec![f32::NAN; 5 * model.config.vocab], vec![7.0; 3]] {
        let reused = model.forward_sequences_reusing(&TOKENS[..4], &mut [&mut model.new_cache()], &[4], &[3, 1], &[], stale).unwrap();
        assert_eq!(reused.logits, fresh.logits);
    }
    // Hidden rows and captured layers handed back to a cache, longer and more (NaN-filled) or shorter than needed,
    // are written over by its next forward.
    let (capture, h) = ([0, 1], model.config.hidden);
    let fresh = model.forward(&TOKENS[..4], &mut model.new_cache(), &[3], &capture).unwrap();
    for (rows, layers) in [(9, 3), (1, 1)] {
        let mut cache = model.new_cache();
        cache.recycle(Forward { hidden: vec![f32::NAN; rows * h], logits: Vec::new(), layer_inputs: vec![vec![f32::NAN; rows * h]; layers] });
        let reused = model.forward(&TOKENS[..4], &mut cache, &[3], &capture).unwrap();
        assert_eq!((&reused.hidden, &reused.layer_inputs, &reused.logits), (&fresh.hidden, &fresh.layer_inputs, &fresh.logits));
    }
}

#[test]
fn context_limit_and_bad_ids_are_errors() {
    let (_dir, model) = load(&Shape::tiny(), DType::F32);
    let long = vec![1u32; model.config.context_length + 1];
    let err = model.forward(&long, &mut model.new_cache(), &[], &[]).unwrap_err();
    assert!(err.to_string().contains("context limit"), "{err}");
    let err = model.forward(&[9999], &mut model.new_cache(), &[], &[]).unwrap_err();
    assert!(err.to_string().contains("outside the model's vocabulary"), "{err}");
}
