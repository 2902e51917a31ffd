//! frspec: how much a speculative-decoding draft loses, and gains, when its vocabulary is pruned (FR-Spec).
//!
//! The folders show the architecture: `speculative` is the engine-independent core (the draft-verify loop, the
//! T = 0 fast path, target-only generation, pruned draft heads) over small traits that `engine::cpu` (bit-exact
//! kernels) and `engine::candle` (CPU or GPU) implement; `loading` gets models (weights, hub, assets), `text` turns
//! prompts into tokens (tokenizer, chat, dataset); `outputs` (Parquet, report, check, plots, manifest) only consume
//! results; `commands` holds what the subcommands do, so `main.rs` parses and dispatches.
//!
//! Data flows one way: settings (`spec`: presets, sweep files, flags) → plan and units (`sweep`) → decode
//! (`speculative` on an engine) → records → summary (`summary`, `stats`) → outputs.

pub mod bench;
pub mod commands;
pub mod engine;
pub mod files;
pub mod loading;
pub mod outputs;
pub mod sampling;
pub mod score;
pub mod speculative;
pub mod spec;
pub mod stats;
pub mod summary;
pub mod sweep;
pub mod synthetic;
pub mod text;
pub mod train;
pub mod vocab;
