#!/usr/bin/env bash
# The small deterministic regression sweep (sweeps/ci-regression.toml: default preset, T = 0 and 1, fixed seed,
# 4 prompts) checked against the committed baseline. Exit 0 pass, 1 regression, 2 unusable input.
# Usage: scripts/regression-check.sh [--update-baseline]
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=$(scripts/frspec-bin.sh)
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
# The default preset ranks by ShareGPT's answers.
[ -f "$cache/freq/sharegpt-smollm2.safetensors" ] || { scripts/fetch-assets.sh sharegpt brown && scripts/build-freq.sh "$frspec"; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$frspec" sweep --config sweeps/ci-regression.toml --out "$out/sweep" --quiet
"$frspec" check --baseline results/baselines/ci --current "$out/sweep" "$@"
