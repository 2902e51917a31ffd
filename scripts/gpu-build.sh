#!/usr/bin/env bash
# Build frspec with CUDA on this machine (no GPU needed) and pack it for a GPU machine: .gpu/frspec.xz, stripped
# and compressed (21.9 MB on 2026-11-30; the binary carries candle's kernels). Then, there: scripts/gpu-check.sh .gpu/frspec.xz OUT
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/frspec-target}"
eval "$(scripts/cuda-toolchain.sh)"
cargo build --release --features cuda --bin frspec
mkdir -p .gpu
strip -o .gpu/frspec "$CARGO_TARGET_DIR/release/frspec"
xz -T0 -6 -f .gpu/frspec
ls -l .gpu/frspec.xz
