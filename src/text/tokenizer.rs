//! Tokenizers from HF `tokenizer.json` (+ `tokenizer_config.json`) or from GGUF metadata, with the ids and the
//! chat template a chat needs.
//!
//! A GGUF file carries its BPE vocabulary and merges, and names its pre-tokenizer (`tokenizer.ggml.pre`); we
//! write the equivalent `tokenizer.json` document and load it with the tokenizers crate, so both sources share
//! one implementation.

use crate::text::chat::ChatTemplate;
use crate::loading::weights::Gguf;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Ids that end a turn: eos, the template's end-of-turn token, and generation_config's eos ids.
    pub stop_ids: Vec<u32>,
    pub chat_template: Option<ChatTemplate>,
    pub vocab_size: usize,
}

/// Pre-tokenizer regexes as llama.cpp defines them per `tokenizer.ggml.pre` (llama-vocab.cpp).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Names templates use for the end of an assistant turn.
const END_OF_TURN_NAMES: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let path = g.path_display();
        let model = g.meta_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            bail!("{path}: tokenizer model '{model}' is not supported (frspec reads gpt2-style BPE GGUF tokenizers)");
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            g.meta(key)
                .ok_or_else(|| anyhow!("{path}: metadata key {key} is missing"))?
                .to_vec()
                .map_err(|e| anyhow!("{path}: {key}: {e}"))?
                .iter()
                .map(|v| v.to_string().cloned().map_err(|e| anyhow!("{path}: {key}: {e}")))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i32> = match g.meta("tokenizer.ggml.token_type") {
            Some(v) => v.to_vec().map_err(|e| anyhow!("{path}: token_type: {e}"))?.iter().map(|t| t.to_i32().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let pre = g.meta_str("tokenizer.ggml.pre").unwrap_or("default");
        let (pre_tokenizer, ignore_merges) = match pre {
            "smollm" => (json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true)]}), false),
            "gpt2" | "default" => (byte_level(true), false),
            "llama-bpe" | "llama3" => (split_then_bytes(LLAMA3_SPLIT), true),
            "qwen2" => (split_then_bytes(QWEN2_SPLIT), false),
            other => bail!("{path}: pre-tokenizer '{other}' is not supported (known: smollm, gpt2, llama-bpe, qwen2)"),
        };
        let vocab: serde_json::Map<String, Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        // Control (3) and user-defined (4) tokens are matched whole in text, as llama.cpp and HF do.
        let added: Vec<Value> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
            .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                                 "normalized": false, "special": types[i] == 3}))
            .collect();
        let doc = json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
            "added_tokens": added,
            "pre_tokenizer": pre_tokenizer,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
        });
        let inner = <tokenizers::Tokenizer as std::str::FromStr>::from_str(&doc.to_string())
            .map_err(|e| anyhow!("{path}: cannot build the tokenizer from GGUF metadata: {e}"))?;
        let id = |key: &str| g.meta_u32(key).ok();
        let (bos_id, eos_id) = (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"));
        let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned().unwrap_or_default();
        let chat_template = g
            .meta_str("tokenizer.chat_template")
            .ok()
            .map(|t| ChatTemplate::new(t, &name(bos_id), &name(eos_id)));
        let stop = [eos_id, id("tokenizer.ggml.eot_token_id"), id("tokenizer.ggml.eom_token_id")];
        Ok(Tokenizer::assemble(inner, bos_id, eos_id, stop.into_iter().flatten().collect(), chat_template))
    }

    /// `dir` holds tokenizer.json and, optionally, tokenizer_config.json and generation_config.json.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let file = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow!("cannot read tokenizer {}: {e}", file.display()))?;
        let config = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let token_text = |key: &str| -> Option<String> {
            let v = config.as_ref()?.get(key)?;
            v.as_str().map(String::from).or_else(|| v.get("content")?.as_str().map(String::from))
        };
        let (bos_text, eos_text) = (token_text("bos_token"), token_text("eos_token"));
        let bos_id = bos_text.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_id = eos_text.as_deref().and_then(|t| inner.token_to_id(t));
        let chat_template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(template_source)
            .map(|t| ChatTemplate::new(&t, bos_text.as_deref().unwrap_or(""), eos_text.as_deref().unwrap_or("")));
        let mut stop: Vec<u32> = eos_id.into_iter().collect();
        if let Some(gen) = read_json_if_present(&dir.join("generation_config.json"))? {
            match gen.get("eos_token_id") {
                Some(Value::Number(n)) => stop.extend(n.as_u64().map(|v| v as u32)),
                Some(Value::Array(a)) => stop.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32)),
                _ => {}
            }
        }
        Ok(Tokenizer::assemble(inner, bos_id, eos_id, stop, chat_template))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        mut stop_ids: Vec<u32>,
        chat_template: Option<ChatTemplate>,
    ) -> Tokenizer {
        stop_ids.extend(END_OF_TURN_NAMES.iter().filter_map(|n| inner.token_to_id(n)));
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let vocab_size = inner.get_vocab_size(true);
        Tokenizer { inner, bos_id, eos_id, stop_ids, chat_template, vocab_size }
    }

    /// Token ids of `text` as written: special-token strings in it are matched, no BOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(|e| anyhow!("tokenizer: {e}"))?.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("tokenizer: {e}"))
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.binary_search(&id).is_ok()
    }

    /// A hash of the vocabulary (id → token text), to tell whether two models share a tokenizer.
    pub fn vocab_hash(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut vocab: Vec<(u32, String)> = self.inner.get_vocab(true).into_iter().map(|(t, i)| (i, t)).collect();
        vocab.sort_unstable();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        vocab.hash(&mut h);
        h.finish()
    }
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false)]})
}

/// A template is a string, or a list of named templates of which "default" is the chat one.
fn template_source(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(String::from)),
        _ => None,
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Some(serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?))
}

impl Tokenizer {
    /// The token ids of a chat rendered with the model's template, ending where the assistant's reply starts.
    pub fn chat_prompt(&self, messages: &[crate::text::chat::Message]) -> Result<Vec<u32>> {
        self.encode(&self.template()?.render(messages, true)?)
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.chat_template.as_ref().ok_or_else(|| anyhow!("the model's tokenizer has no chat template"))
    }

    /// The token ids of a chat up to where the user's first message begins (after the template's default system
    /// prompt, if any): what an instruct model continues with a request of the kind it was tuned on (Magpie).
    pub fn user_turn_prefix(&self) -> Result<Vec<u32>> {
        const MARK: &str = "\u{1}frspec-user-message\u{1}";
        let text = self.template()?.render(&[crate::text::chat::Message::new("user", MARK)], false)?;
        let cut = text.find(MARK).ok_or_else(|| anyhow!("the chat template does not show the user's message as written"))?;
        self.encode(&text[..cut])
    }
}
