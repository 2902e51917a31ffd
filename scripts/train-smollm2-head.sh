#!/usr/bin/env bash
# The recipe of the shipped EAGLE-1 head for SmolLM2-135M-Instruct (heads/smollm2-135m-eagle1/).
# Data: 2,400 prompts made from the Brown corpus answered greedily by the target itself (8 at a time), 1,500 Brown
# passages to continue answered by the corpus text that follows them (teacher-forced, read in one forward), and
# 2,800 requests the target writes itself (Magpie: its chat template up to the user's turn, sampled at T = 1) that it
# then answers; never MT-Bench. Six epochs over all three against the Brown keep set at ratio 0.75 (the teacher
# distribution over the 12,289 most frequent ids, FR-Spec's own idea applied to training: a step costs a quarter of a
# full-vocabulary one), true features only. About 10,100 s from nothing on 2 cores
# (results/train/smollm2-135m-eagle1.md). The training folder (teacher data, checkpoints) lives in the asset cache;
# re-running resumes it. Then the head is copied into heads/.
# Usage: scripts/train-smollm2-head.sh [path to a frspec binary] [more train-eagle flags, e.g. --teacher-from DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
shift || true
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
[ -f "$cache/freq/brown-smollm2.safetensors" ] || scripts/build-freq.sh "$frspec"
run="$cache/train/smollm2-135m-eagle1-keep75-p2400-c1500-sp2800"
start=$(date +%s)
"$frspec" train-eagle --target smollm2 --corpus "$cache/brown" --format tagged --out "$run" \
  --prompts 2400 --continuations 1500 --self-prompts 2800 --max-new-tokens 160 --steps 10050 --batch 4 --lr 1e-3 --warmup 40 \
  --checkpoint-every 100 --seed 0 --freq brown-smollm2 --ratio 0.75 "$@"
echo "recipe wall time: $(( $(date +%s) - start )) s"
mkdir -p heads/smollm2-135m-eagle1
cp "$run/config.json" "$run/model.safetensors" "$run/training_log.jsonl" "$run/training_curve.png" "$run/training_curve.svg" heads/smollm2-135m-eagle1/
