#!/usr/bin/env bash
# Decode and prefill speed of frspec and llama.cpp on the same GGUF, same machine, same thread count, in one run.
# frspec runs with 8-bit activations on every quantized row (FRSPEC_ACTIVATIONS=q8: integer sums, llama.cpp's
# arithmetic); a file with K-quant matrices also with f32 activations (FRSPEC_ACTIVATIONS=f32). Also records the
# memory frspec holds against the file's size.
# Needs the venv of scripts/setup-numerics-env.sh.
# Usage: scripts/bench-vs-llamacpp.sh [frspec binary] [runs] [model.gguf]
#   default binary: built here with cargo; default model: SmolLM2-135M-Instruct Q4_1 (results/bench/decode-vs-llamacpp.*);
#   another model writes results/bench/decode-vs-llamacpp-<file stem>.{md,json}.
# The engines take turns, ROUNDS times (default 3), `runs` timed runs each per turn: on a shared (virtual) machine the
# speed available drifts by 30% or more from minute to minute, so figures taken one engine after the other compare
# different machines. Medians are over every timed run of an engine.
# BASELINE=<another frspec binary> (say, the build before a kernel change) joins every turn as a third engine, so a
# change is measured against itself and llama.cpp in the same minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
runs=${2:-5}
model=${3:-}
py=${FRSPEC_PY:-$HOME/.cache/frspec-py/bin/python}
out=results/bench
mkdir -p "$out"
threads=2
name=decode-vs-llamacpp
model_args=()
if [ -n "$model" ]; then
  name="decode-vs-llamacpp-$(basename "$model" .gguf)"
  model_args=(--model "$model")
fi
rounds=${ROUNDS:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
kquants=
for round in $(seq "$rounds"); do
  RAYON_NUM_THREADS=$threads "$py" scripts/bench_llamacpp.py --threads $threads --runs "$runs" "${model_args[@]}" > "$tmp/llama.$round"
  RAYON_NUM_THREADS=$threads FRSPEC_ACTIVATIONS=q8 "$frspec" bench decode --runs "$runs" --json "${model_args[@]}" > "$tmp/ours.$round"
  if [ -z "$kquants" ]; then
    kquants=$("$py" -c 'import json, sys; print(int(any(t.endswith("_k") for t in json.load(open(sys.argv[1]))["weight_types"])))' "$tmp/ours.$round")
  fi
  if [ -n "${BASELINE:-}" ]; then
    RAYON_NUM_THREADS=$threads FRSPEC_ACTIVATIONS=q8 "$BASELINE" bench decode --runs "$runs" --json "${model_args[@]}" > "$tmp/base.$round"
  fi
  if [ "$kquants" = 1 ]; then
    RAYON_NUM_THREADS=$threads FRSPEC_ACTIVATIONS=f32 "$frspec" bench decode --runs "$runs" --json "${model_args[@]}" > "$tmp/exact.$round"
  fi
done
"$py" - "$tmp" "$rounds" "$runs" "$threads" "$out/$name" <<'PY'
import json, platform, statistics, sys
from pathlib import Path
tmp, rounds, runs, threads, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
def load(kind):
    return [json.loads((tmp / f"{kind}.{r}").read_text()) for r in range(1, rounds + 1) if (tmp / f"{kind}.{r}").exists()]
llama_rounds, ours_rounds, exact_rounds, base_rounds = load("llama"), load("ours"), load("exact"), load("base")
def pooled(rs, decode, prefill):
    first = dict(rs[0])
    first["decode_tok_s_all"], first["prefill_tok_s_all"] = [v for r in rs for v in decode(r)], [v for r in rs for v in prefill(r)]
    first["decode_tok_s"], first["prefill_tok_s"] = (statistics.median(first[k]) for k in ("decode_tok_s_all", "prefill_tok_s_all"))
    return first
llama = pooled(llama_rounds, lambda r: [x["decode_tok_s"] for x in r["runs"]], lambda r: [x["prefill_tok_s"] for x in r["runs"]])
ours_of = lambda rs: pooled(rs, lambda r: r["decode_tok_s_runs"], lambda r: r["prefill_tok_s_runs"])
ours = ours_of(ours_rounds)
exact = ours_of(exact_rounds) if exact_rounds else None
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
types = ", ".join(f"{n} {t}" for t, n in ours["weight_types"].items())
engines = [("frspec", ours)] if exact is None else [("frspec, 8-bit activations", ours), ("frspec, f32 activations", exact)]
if base_rounds:
    engines.append(("frspec baseline binary", ours_of(base_rounds)))
head = "| | llama.cpp | " + " | ".join(n for n, _ in engines) + " | " + " | ".join(f"{n} ÷ llama.cpp" for n, _ in engines) + " |"
rows = [(f"decode tokens/s ({ours['new_tokens']} new tokens)", "decode_tok_s"),
        (f"prefill tokens/s ({ours['prompt_tokens']}-token chat prompt)", "prefill_tok_s")]
md = [f"# Decode and prefill speed: frspec vs llama.cpp ({llama['model_file']})", "",
      f"Matrices: {types}. {cpu}, {threads} threads each; the engines took turns {rounds} times, {runs} timed runs",
      "each a turn after one warm-up; medians over all of an engine's runs, measured in one run by",
      "`scripts/bench-vs-llamacpp.sh`.", "", head, "|---|---:|" + "---:|" * (2 * len(engines))]
for label, key in rows:
    md.append(f"| {label} | {llama[key]:.1f} | " + " | ".join(f"{e[key]:.1f}" for _, e in engines) + " | "
              + " | ".join(f"{e[key] / llama[key]:.2f}" for _, e in engines) + " |")
mib = 1 << 20
md += ["", f"Memory (frspec, 8-bit activations): weights {ours['weight_bytes'] / mib:.1f} MiB, peak resident "
       f"{ours['peak_rss_bytes'] / mib:.1f} MiB, file {ours['file_bytes'] / mib:.1f} MiB: "
       f"{ours['peak_rss_bytes'] / ours['file_bytes']:.2f}× the file (peak resident, everything included).", "",
       f"frspec: a {ours['block']}-token block forward (verification, logits for every row) costs, against a one-token "
       "forward at the same position: " + "; ".join(f"{n} {statistics.median(r['block_cost_ratio'] for r in rs):.2f}×"
       for n, rs in [("frspec", ours_rounds), ("baseline binary", base_rounds)] if rs) + " (median of the turns).", "",
       f"llama.cpp: llama-cpp-python {llama.get('llama_cpp_python_version', '?')}. Decode tokens/s of every run, in "
       "turn order: llama.cpp " + ", ".join(f"{v:.1f}" for v in llama["decode_tok_s_all"]) + "; "
       + "; ".join(f"{n} " + ", ".join(f"{v:.1f}" for v in e["decode_tok_s_all"]) for n, e in engines) + "."]
open(f"{out}.md", "w").write("\n".join(md) + "\n")
json.dump({"llama_cpp": llama_rounds, "frspec": ours_rounds, "frspec_f32_activations": exact_rounds, "frspec_baseline": base_rounds}, open(f"{out}.json", "w"), indent=1)
print("\n".join(md))
PY
