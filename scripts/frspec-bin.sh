#!/usr/bin/env bash
# Build frspec (release) and print the binary's path; honours CARGO_TARGET_DIR. Used by the other scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
echo "$dir/release/frspec"
