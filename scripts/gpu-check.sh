#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and no network, with a frspec built elsewhere by
#   eval "$(scripts/cuda-toolchain.sh)" && cargo build --release --features cuda
# Downloads nothing: every model is synthetic. Parts 1-3 took about 150 s on one H200 (2026-12-04, the batched loop
# included); part 4 did not finish there: its first CPU-engine sweep made no unit in 7 minutes (16 threads; the
# deadlock of with_pool_awake fixed in b644a10 is the likely cause), so each of its sweeps now stops after 2 minutes
# and fails the check instead of spending the GPU's time. In the batched loop every slot's keys and values are one
# slot of a pool a layer, and one launch a layer attends all slots' rows; the slots' EAGLE layers run in one forward
# a drafting position, and slots sharing a head (here all of them: one ratio) take one head product per position; a
# real sweep spreads its slots over the ratios, so there a head is shared by about B / ratios slots.
#   1. agreement: greedy tokens of a synthetic model in f32 on the GPU against the CPU engine (exit 1 if they differ)
#   2. bench head at Llama-3.1 size (H 4096, V 128256) in bf16, B = 1 … 1024, every ratio
#   3. bench decode at Llama-3.1-8B shape in bf16 (random weights): target-only tokens/s, verification passes of
#      k + 1 = 5 and 64 tokens, and the speculative loop with a random EAGLE-1 head at each ratio (its tokens/s and
#      drafting time; acceptance is meaningless with random weights, speed is not), each against the limit the
#      measured read bandwidth sets for the bytes it must read (printed as a table after the JSON); then the
#      batched speculative loop at B = 1, 8, 32, 64, at T = 0 and T = 1 (steps/s, and the minutes the llama31-eagle
#      preset's sampled cells with 5 repeats and 2 turns would take at that speed for mean acceptance lengths 1.5–3;
#      at T = 1 the loop verifies with the target's distributions, computed and drawn from on the device, which
#      T = 0's row leaves out)
#   4. sweeps of a synthetic target on the GPU (candle engine, f32) against the same sweeps on the CPU engine, drafted
#      three ways: by the target's first three layers (a draft model), and by an EAGLE-1 and an EAGLE-3 head built
#      from its first layer (`synthetic-model --eagle-head/--eagle3-head`: random heads' drafts are almost never
#      accepted, and records of nothing accepted agree whatever was drafted), 8 slots a batch, so the GPU feeds the
#      slots' EAGLE drafts together: `check` must pass and every T = 0 record must be identical (exit 1 otherwise);
#      scripts/compare-sweeps.py also says how close the sampled records are. The three pairs took 97 s on the 2-core
#      development machine with the candle engine on the CPU standing in for the GPU (2026-12-02).
# Usage: scripts/gpu-check.sh FRSPEC_BINARY[.xz] OUT_DIR   (figures and logs go to OUT_DIR)
# scripts/gpu-build.sh makes .gpu/frspec.xz, small enough to travel to a GPU machine with the checkout.
set -euo pipefail

. "$(dirname "$0")/gpu-binary.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.csv"

status=0

echo "== 1. GPU (f32) against the CPU engine, greedy tokens of a synthetic model" | tee "$out/agreement.txt"
"$bin" synthetic-model --out "$work/synthetic" --hidden 512 --layers 6 --vocab 4096 --seed 7 >/dev/null
"$bin" bench decode --model "$work/synthetic" --device cuda --dtype f32 --compare-engine --new-tokens 64 --runs 2 \
  --ratios 0 2>&1 | tee -a "$out/agreement.txt" || status=1

echo "== 2. bench head, H 4096, V 128256, bf16"
"$bin" bench head --hidden 4096 --vocab 128256 --batch 1,4,16,64,256,1024 --ratios 0,0.5,0.75,0.9,0.99 \
  --device cuda --dtype bf16 --out "$out/head" | tee "$out/head.txt"

echo "== 3. bench decode, Llama-3.1-8B shape, bf16, random weights"
"$bin" bench decode --shape llama31-8b --device cuda --dtype bf16 --new-tokens 128 --runs 3 --json > "$out/decode-llama31-8b.json"
python3 - "$out/decode-llama31-8b.json" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
bw, limit = b["device_bytes_per_sec"], b["step_limit_secs"]
print(f"read bandwidth {bw / 1e9:.0f} GB/s; a step reads {b['weight_bytes_per_token'] / 1e9:.2f} GB: limit {1e3 * limit:.3f} ms = {1 / limit:.1f} tokens/s")
print(f"{'what':<28} {'ms':>9} {'limit ms':>9} {'share':>7}")
print(f"{'decode (1 token)':<28} {1e3 * b['decode_step_secs']:>9.3f} {1e3 * limit:>9.3f} {100 * b['bandwidth_share']:>6.1f}%   {b['decode_tok_s']:.1f} tokens/s")
print(f"{'  host enqueue / synced':<28} {1e3 * b['decode_enqueue_secs']:>9.3f} {1e3 * b['decode_synced_secs']:>9.3f}")
print(f"{'  synced, products attention':<28} {1e3 * b['decode_products_synced_secs']:>9.3f}")
for v in b["verify"]:
    print(f"{'verify ' + str(v['tokens']) + ' tokens':<28} {1e3 * v['secs']:>9.3f} {1e3 * limit:>9.3f} {100 * v['share']:>6.1f}%")
for d in b["drafts"]:
    print(f"{'EAGLE-1 draft, ratio ' + str(d['ratio']):<28} {1e3 * d['draft_step_secs']:>9.3f} {1e3 * d['draft_limit_secs']:>9.3f} {100 * d['draft_share']:>6.1f}%   loop {d['loop_tok_s']:.1f} tokens/s")
lengths = b["acceptance_lengths"]
print(f"{'batched loop, T':<16} {'B':>4} {'steps/s':>9} {'tokens/s':>9}" + "".join(f" {'preset min@' + str(l):>15}" for l in lengths))
for l in b["batched"]:
    print(f"{l['temperature']:<16} {l['batch']:>4} {l['steps_per_sec']:>9.1f} {l['tok_s']:>9.1f}" + "".join(f" {m:>15.1f}" for m in l["preset_minutes"]))
PY

echo "== 4. sweeps on the GPU (candle engine, f32) against the same sweeps on the CPU engine"
# The byte tokenizer has 258 ids; a model of that vocabulary matches the frequency file counted with it.
"$bin" synthetic-model --out "$work/sweep-target" --hidden 512 --layers 6 --vocab 258 --seed 7 \
  --eagle-head "$work/eagle1" --eagle3-head "$work/eagle3" >/dev/null
python3 - "$work" <<'PY'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
topics = ["rivers", "prime numbers", "a letter to a friend", "the moon", "sorting a list", "tea", "chess", "rain"]
with open(work / "questions.jsonl", "w") as f:
    for i, t in enumerate(topics):
        f.write(json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"Write about {t}."]}) + "\n")
(work / "corpus.txt").write_text("\n".join(f"The {t} and the words we use to tell of {t}, again and again." for t in topics * 20))
PY
"$bin" freq build --tokenizer "$work/sweep-target" --corpus "$work/corpus.txt" --out "$work/freq.safetensors" >/dev/null
compare_engines() {
  local name=$1
  shift
  local sweep=(sweep --model "$work/sweep-target" "$@" --freq "$work/freq.safetensors" --dataset "$work/questions.jsonl"
               --ratios 0,0.5,0.9 --temperatures 0,1 --repeats 2 --max-new-tokens 48 --k 4 --batch 8 --quiet)
  echo "-- drafted by $name"
  timeout 120 "$bin" "${sweep[@]}" --out "$out/sweep-$name-cpu" > "$out/sweep-$name-cpu.txt" \
    || { echo "sweep on the CPU engine failed or ran past 2 minutes"; status=1; return; }
  timeout 120 "$bin" "${sweep[@]}" --device cuda --dtype f32 --out "$out/sweep-$name-cuda" > "$out/sweep-$name-cuda.txt" \
    || { echo "sweep on the GPU failed or ran past 2 minutes"; status=1; return; }
  "$bin" check --baseline "$out/sweep-$name-cpu" --current "$out/sweep-$name-cuda" > "$out/sweep-$name-check.txt" || status=1
  grep "T=0 mean acceptance length" "$out/sweep-$name-cuda.txt" || true
  tail -n 3 "$out/sweep-$name-check.txt"
  python3 "$(dirname "$0")/compare-sweeps.py" "$out/sweep-$name-cpu" "$out/sweep-$name-cuda" \
    | tee "$out/sweep-$name-compare.txt" || status=1
}
compare_engines truncated3 --draft-kind truncated:3
compare_engines eagle1 --draft-kind eagle --draft "$work/eagle1"
compare_engines eagle3 --draft-kind eagle3 --draft "$work/eagle3"

exit $status
