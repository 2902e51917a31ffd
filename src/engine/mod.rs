//! The engines the speculative core runs on, each implementing `speculative::{Target, Draft, HeadRows}`:
//! `cpu`, frspec's own kernels (f32 activations, quantized weights, bit-exact blocks: the reference the
//! losslessness tests need), and `candle`, candle tensors on the CPU or a GPU in f32, f16 or bf16.

pub mod candle;
pub mod cpu;

/// Which engine runs a sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// frspec's CPU kernels (the default on the CPU).
    Cpu,
    /// candle's tensors on `--device` in `--dtype` (the default on a GPU).
    Candle,
}

impl EngineKind {
    pub fn is_cpu(&self) -> bool {
        *self == EngineKind::Cpu
    }
}
