#!/usr/bin/env bash
# The recipes of the heads shipped for SmolLM2-135M-Instruct, from nothing; the training folder (teacher data,
# checkpoints) lives in the asset cache and re-running resumes it. Then the head is copied into heads/ (its curve as
# PNG only: the SVGs would take megabytes of what travels to a GPU machine).
#
# eagle1 (heads/smollm2-135m-eagle1/, the default preset's): 2,400 prompts made from the Brown corpus answered
# greedily by the target itself (16 at a time, 8 when the recipe was timed: the same answers), 1,500 Brown passages to
# continue answered by the corpus text that follows them (teacher-forced, read in one forward), and 2,800 requests the
# target writes itself (Magpie: its chat template up to the user's turn, sampled at T = 1) that it then answers; never
# MT-Bench. Six epochs over all three against the Brown keep set at ratio 0.75 (the teacher distribution over the
# 12,289 most frequent ids, FR-Spec's own idea applied to training: a step costs a quarter of a full-vocabulary one),
# true features only. About 10,100 s when timed (results/train/smollm2-135m-eagle1.md); since 2026-12-03 a training
# step takes ≈ 0.73-0.78 of its time then and an answer ≈ 0.86 (results/train/training-speed-2026-12-03.md). Then
# two epochs from that head over the first 8,800 distinct ShareGPT requests answered by the target with 8-bit
# activations (lr 3e-4, warm-up 20), against the whole vocabulary (a step ≈ 2.3x a keep-set one; +0.080 at full
# vocabulary over the same stage against the keep set on 4,800 requests, +0.028 more from 8,800): answers ≈ 3,200 s
# (0.36 s each alone, estimated) and training 6,108 s (1.28-1.4 s a step; ≈ 1.0 s since the training-speed change
# of late 2026-12-04, the same bits) on the 2-core Intel VM of 2026-12-04,
# +0.199 acceptance length on MT-Bench over stage one's head. Then one epoch from that head over the same answers
# with EAGLE-3's training-time test (--unroll 2: two more draft steps on the head's own features; lr 3e-4, warm-up
# 20): 2,200 steps at ≈ 2.4 s (≈ 5,300 s alone, 2026-12-05), +0.042 on MT-Bench over the second stage's head;
# then one more such epoch from that head (a fourth stage, the same settings): +0.030, 2.003 on MT-Bench.
#
# eagle3 (heads/smollm2-135m-eagle3/, preset smollm2-eagle3): the first 2,400 distinct ShareGPT requests answered by
# the target, its residual streams entering layers 2, 15 and 27 kept; a draft vocabulary of the 8,192 ids its
# answers hold most often; the token term alone with the training-time test over 2 further steps; four epochs, then
# two more from that head with a schedule of their own (--init-from: lr 3e-4, warm-up 20). About 3,300 s of data and
# 5,900 + 3,000-3,900 s of training when timed (results/train/smollm2-135m-eagle3.md), ≈ 9,600-10,600 s in all
# estimated from the faster steps and answers since. Then one epoch from that head over the first 3,600 requests
# answered with 8-bit activations (data of its own: ≈ 2,000 s; 900 steps, 1,641 s on a 2-core Intel Xeon), +0.030
# on MT-Bench, 1.591; then one epoch over the first 8,800 (the 3,600 answers taken over, 5,200 more in ≈ 2,900 s
# alone; 2,200 steps at ≈ 1.5 s), +0.060, 1.651; then one epoch over those 8,800 answers again and 2,800 requests the
# target writes itself (Magpie, as EAGLE-1's first stage; 720 s of requests and 1,269 s of answers; 2,900 steps in
# 4,120 s), +0.044, 1.695; then one epoch over all those and EAGLE-1's Brown data (2,400 prompts answered in
# 1,033 s, 1,500 continuations read in 562 s; 3,875 steps in 5,416 s), +0.090, 1.785; then a second epoch over the
# same (3,875 steps in ≈ 6,500 s, partly beside builds), +0.077, 1.862; then one epoch over all of it and 6,633
# ShareGPT follow-ups (users' later requests with the turns before them; ≈ 1.0 s each to answer alone, 5,533 steps
# in ≈ 6,900 s at ≈ 1.25 s), +0.102, 1.964; then a second epoch over the same (5,533 steps, the last 5,033 in 5,595 s
# after a resume, ≈ 1.1 s a step nearly alone on a 2-core AMD EPYC Zen 4), +0.081, 2.045; then one epoch over all of
# it and 5,200 more self-prompted requests (8,000; ≈ 0.29 s each to answer on that Zen 4; 6,833 steps in 7,581 s),
# +0.053, 2.099; then a second epoch over the same (6,833 steps in 7,778 s), +0.034, 2.132; then one epoch over all
# of it and 2,400 more Brown prompts and 1,500 more continuations (7,808 steps in 8,707 s), +0.041, 2.173.
# Packed in Q8_0 (frspec pack-head); each
# stage from the third starts from the head before packed, as shipped and measured. Since 2026-12-06, when the
# eighth stage ran, a step over the seventh stage's data takes ≈ 0.8 of its time then
# (results/train/training-speed-2026-12-06.md).
# Usage: scripts/train-smollm2-head.sh [eagle1|eagle3] [path to a frspec binary] [more train-eagle flags for the first
#        stage, e.g. --teacher-from DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# The target's arithmetic when the shipped heads' teacher data was made (f32 activations against its Q4_1 rows; the
# default became 8-bit activations later), so the recipes stay the ones measured; EAGLE-1's second stage was made
# with the 8-bit activations (q8: its answers in 0.73x the time, no loss measured).
export FRSPEC_ACTIVATIONS=kquants
second_activations=kquants
later_stages=()
arch=eagle1
if [ "${1:-}" = eagle1 ] || [ "${1:-}" = eagle3 ]; then arch=$1; shift; fi
frspec=${1:-$(scripts/frspec-bin.sh)}
shift || true
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
[ -f "$cache/freq/brown-smollm2.safetensors" ] || scripts/build-freq.sh "$frspec"
[ -f "$cache/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json" ] || scripts/fetch-assets.sh sharegpt
# EAGLE-1's recipe has four stages, EAGLE-3's twelve; each after the first starts from the head before with fresh
# optimizer moments and a schedule of its own (--init-from).
case $arch in
  eagle1) run="$cache/train/smollm2-135m-eagle1-keep75-p2400-c1500-sp2800"
          recipe=(--prompts 2400 --continuations 1500 --self-prompts 2800 --freq brown-smollm2 --ratio 0.75); steps=10050
          second=(--prompts 0 --sharegpt 8800); second_name=sg8800-2ep-q8-fullvocab
          second_steps=4400; second_activations=q8
          # Two more epochs, one stage each, with the training-time test.
          later=(--unroll 2); later_stages=("tt2-1ep 0 0 8800 0 0" "tt2-2ep 0 0 8800 0 0") ;;
  eagle3) run="$cache/train/smollm2-135m-eagle3-sg2400-u2-4ep"
          recipe=(--arch eagle3 --draft-vocab 8192 --prompts 0 --sharegpt 2400 --unroll 2); steps=2400
          second=("${recipe[@]}" --teacher-from "$run"); second_name=restart2; second_steps=1200
          later=(--arch eagle3 --draft-vocab 8192 --unroll 2)
          later_stages=("sg3600-q8 0 0 3600 0 0" "sg8800-q8 0 0 8800 0 0" "sg8800-sp2800-q8 0 0 8800 2800 0" "p2400-c1500-q8 2400 1500 8800 2800 0"
                        "p2400-c1500-q8-2ep 2400 1500 8800 2800 0" "fu6633-q8 2400 1500 8800 2800 6633"
                        "fu6633-q8-2ep 2400 1500 8800 2800 6633" "sp8000-q8 2400 1500 8800 8000 6633"
                        "sp8000-q8-2ep 2400 1500 8800 8000 6633" "p4800-c3000-q8 4800 3000 8800 8000 6633") ;;
esac
start=$(date +%s)
train() {
  "$frspec" train-eagle --target smollm2 --corpus "$cache/brown" --format tagged --max-new-tokens 160 \
    --batch 4 --checkpoint-every 100 --seed 0 "$@"
}
train --out "$run" --lr 1e-3 --warmup 40 --steps "$steps" "${recipe[@]}" "$@"
first=$run
run=$first-$second_name
FRSPEC_ACTIVATIONS=$second_activations train --out "$run" --lr 3e-4 --warmup 20 --steps "$second_steps" "${second[@]}" --init-from "$first"
# Later stages answer with 8-bit activations. Each takes over the stage before's answers (--teacher-from) where they
# are its requests made so; EAGLE-3's first later stage makes its own (more requests; its stages before had f32).
# A later stage: its name, then its Brown prompts, continuations, ShareGPT requests, self-prompted requests and
# ShareGPT follow-ups (later requests with the turns before them).
for stage in "${later_stages[@]}"; do
  read -r name prompts continuations requests self_prompts follow_ups <<< "$stage"
  previous=$run
  run=$previous-$name
  teacher=(--teacher-from "$previous")
  init=$previous
  if [ "$arch" = eagle3 ]; then
    # Each was measured from the head before as it shipped, packed in Q8_0: its rounding is part of the recipe.
    init=$previous-packed
    "$frspec" pack-head "$previous" --out "$init"
    if [ "$previous" = "$first-$second_name" ]; then teacher=(); fi
  fi
  # One epoch over the stage's conversations, four a step.
  FRSPEC_ACTIVATIONS=q8 train --out "$run" --lr 3e-4 --warmup 20 --steps $(((prompts + continuations + requests + self_prompts + follow_ups) / 4)) \
    --prompts "$prompts" --continuations "$continuations" --sharegpt "$requests" --self-prompts "$self_prompts" \
    --sharegpt-follow-ups "$follow_ups" "${later[@]}" \
    --init-from "$init" "${teacher[@]}"
done
echo "recipe wall time: $(( $(date +%s) - start )) s"
head=heads/smollm2-135m-$arch
mkdir -p "$head"
cp "$run/training_log.jsonl" "$run/training_curve.png" "$head/"
case $arch in
  eagle1) cp "$run/config.json" "$run/model.safetensors" "$head/" ;;
  eagle3) "$frspec" pack-head "$run" --out "$head" ;;
esac
