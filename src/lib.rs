//! frspec: how much a speculative-decoding draft loses, and gains, when its vocabulary is pruned (FR-Spec).
//!
//! Data flows one way: a target model (`model`, loaded by `target` from `weights` through `hub` or `assets`)
//! and its `tokenizer` / `chat` template turn prompts into tokens; `generate` decodes, `score` teacher-forces,
//! `bench` times. A sweep flows spec (presets, sweep files, flags) → sweep (cells, units, resume) → decode →
//! records → summary (stats) → store (Parquet) and report.

pub mod assets;
pub mod bench;
pub mod chat;
pub mod check;
pub mod dataset;
pub mod engine;
pub mod hub;
pub mod manifest;
pub mod plot;
pub mod report;
pub mod sampling;
pub mod score;
pub mod speculative;
pub mod spec;
pub mod stats;
pub mod store;
pub mod summary;
pub mod sweep;
pub mod synthetic;
pub mod target;
pub mod tokenizer;
pub mod train;
pub mod vocab;
pub mod weights;
