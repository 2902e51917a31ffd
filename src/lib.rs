//! frspec: how much a speculative-decoding draft loses, and gains, when its vocabulary is pruned (FR-Spec).
//!
//! Data flows one way: a target model (`model`, loaded by `target` from `weights` through `hub` or `assets`)
//! and its `tokenizer` / `chat` template turn prompts into tokens; `generate` decodes, `score` teacher-forces,
//! `bench` times.

pub mod assets;
pub mod bench;
pub mod chat;
pub mod dataset;
pub mod decode;
pub mod draft;
pub mod generate;
pub mod hub;
pub mod model;
pub mod sampling;
pub mod score;
pub mod stats;
pub mod sweep;
pub mod synthetic;
pub mod target;
pub mod tensor;
pub mod tokenizer;
pub mod vocab;
pub mod weights;
