#!/usr/bin/env bash
# Acceptance of the shipped SmolLM2 EAGLE-1 head on all 80 MT-Bench first turns (k = 4, T = 0, 128 new tokens),
# beside an untrained head of the same shape and the truncated-target stand-in, and at ratios 0.5 / 0.75 / 0.9 with
# the Brown frequency file. Writes results/train/eval/<draft>/ (runs, summary, manifest, report.md); another head
# given as NAME=FOLDER (EAGLE-1 or EAGLE-3, read from its config.json) is evaluated like the shipped one into
# results/train/eval/NAME/ (an EAGLE-3 head's keep sets are the Brown ones within its draft vocabulary), and `frspec compare
# results/train/eval/trained results/train/eval/NAME` pairs the two.
# Usage: scripts/eval-smollm2-head.sh [path to a frspec binary] [trained|untrained|truncated16|NAME=FOLDER ...]
#        (default: the first three)
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
shift || true
wanted=("${@:-trained untrained truncated16}")
wanted=" ${wanted[*]} "
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ $wanted != *" untrained "* ]] ||
  "$frspec" train-eagle --target smollm2 --corpus "$cache/brown" --format tagged --out "$work/untrained-head" --steps 0 --quiet
# kquants: the activations of every evaluation in results/train/eval (made before 8-bit activations became the
# default), so that a new head pairs with them.
common=(--model smollm2 --dataset mt-bench --num-prompts 80 --temperatures 0 --repeats 1 --k 4 --max-new-tokens 128
        --turns 1 --freq brown-smollm2 --activations kquants --quiet)
run() {
  local name=$1; shift
  [[ $wanted == *" $name "* ]] || return 0
  "$frspec" sweep "${common[@]}" "$@" --out "$work/$name"
  mkdir -p "results/train/eval/$name"
  cp "$work/$name/runs.parquet" "$work/$name/summary.parquet" "$work/$name/timing_summary.parquet" "$work/$name/manifest.json" "results/train/eval/$name/"
  "$frspec" report "$work/$name" --out "results/train/eval/$name/report.md"
}
run trained --draft heads/smollm2-135m-eagle1 --draft-kind eagle --ratios 0,0.5,0.75,0.9
run untrained --draft "$work/untrained-head" --draft-kind eagle --ratios 0
run truncated16 --draft-kind truncated:16 --ratios 0
for arg in $wanted; do
  if [[ $arg == *=* ]]; then
    wanted+=" ${arg%%=*} "
    kind=eagle
    grep -q LlamaForCausalLMEagle3 "${arg#*=}/config.json" && kind=eagle3
    run "${arg%%=*}" --draft "${arg#*=}" --draft-kind "$kind" --ratios 0,0.5,0.75,0.9
  fi
done
