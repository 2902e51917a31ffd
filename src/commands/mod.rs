//! What the subcommands do beyond parsing their flags: each reads its inputs, runs the library's pieces and writes
//! its outputs. `main.rs` parses and dispatches here.

pub mod bench;
pub mod freq;
pub mod generate;
pub mod score;
pub mod sweep;
