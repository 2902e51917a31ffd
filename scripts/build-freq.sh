#!/usr/bin/env bash
# Brown-corpus token frequencies for the Llama-3.1 and SmolLM2 tokenizers, written into the asset cache, and
# their coverage tables into results/freq/. Needs scripts/fetch-assets.sh first.
# Usage: scripts/build-freq.sh [path to a frspec binary; default: built here with cargo]
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
mkdir -p "$cache/freq" results/freq
for tok in llama31-tokenizer smollm2; do
  out="$cache/freq/brown-$tok.safetensors"
  # Relative to the cache, so the file (and its sha256, which sweeps record) is the same on every machine.
  (cd "$cache" && "$frspec" freq build --tokenizer "$tok" --corpus brown --format tagged --out "freq/brown-$tok.safetensors")
  {
    echo "# Brown corpus coverage, $tok"
    echo
    echo "Command: \`frspec freq build --tokenizer $tok --corpus \$FRSPEC_CACHE/brown --format tagged --out $(basename "$out")\`"
    echo "then \`frspec freq show $(basename "$out")\`. Coverage = share of the corpus's tokens whose id is kept."
    echo
    echo '```'
    "$frspec" freq show "$out" --ratios 0.25,0.5,0.75,0.9,0.95,0.99 | grep -v '^corpus:'
    echo '```'
  } >"results/freq/brown-$tok.md"
done
