#!/usr/bin/env bash
# Token frequencies for the Llama-3.1 and SmolLM2 tokenizers, written into the asset cache, and their coverage
# tables into results/freq/: from the Brown corpus (prose, FR-Spec's corpus counts in small), and, where the ShareGPT
# asset is in the cache (scripts/fetch-assets.sh sharegpt), from ShareGPT's answers (chat answers with their code,
# maths and tables: the ids a chat model writes). Needs scripts/fetch-assets.sh brown first.
# Usage: scripts/build-freq.sh [path to a frspec binary; default: built here with cargo]
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
mkdir -p "$cache/freq" results/freq
corpora=("brown brown tagged Brown corpus")
[ ! -f "$cache/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json" ] ||
  corpora+=("sharegpt sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json sharegpt ShareGPT answers")
for corpus in "${corpora[@]}"; do
  read -r name path format title <<<"$corpus"
  for tok in llama31-tokenizer smollm2; do
    out="$cache/freq/$name-$tok.safetensors"
    # Relative to the cache, so the file (and its sha256, which sweeps record) is the same on every machine.
    (cd "$cache" && "$frspec" freq build --tokenizer "$tok" --corpus "$path" --format "$format" --out "freq/$name-$tok.safetensors")
    {
      echo "# $title coverage, $tok"
      echo
      echo "Command: \`frspec freq build --tokenizer $tok --corpus \$FRSPEC_CACHE/$path --format $format --out $(basename "$out")\`"
      echo "then \`frspec freq show $(basename "$out")\`. Coverage = share of the corpus's tokens whose id is kept."
      echo
      echo '```'
      "$frspec" freq show "$out" --ratios 0.25,0.5,0.75,0.9,0.95,0.99 | grep -v '^corpus:'
      echo '```'
    } >"results/freq/$name-$tok.md"
  done
done
