#!/usr/bin/env bash
# Decode and prefill speed of frspec and llama.cpp on the same GGUF, same machine, same thread count, in one run.
# Needs the venv of scripts/setup-numerics-env.sh. Writes results/bench/decode-vs-llamacpp.{md,json}.
# Usage: scripts/bench-vs-llamacpp.sh [frspec binary] [runs]  (default: built here with cargo)
set -euo pipefail
cd "$(dirname "$0")/.."
frspec=${1:-$(scripts/frspec-bin.sh)}
runs=${2:-5}
py=${FRSPEC_PY:-$HOME/.cache/frspec-py/bin/python}
out=results/bench
mkdir -p "$out"
threads=2
llama=$(RAYON_NUM_THREADS=$threads "$py" scripts/bench_llamacpp.py --threads $threads --runs "$runs")
ours=$(RAYON_NUM_THREADS=$threads "$frspec" bench decode --runs "$runs" --json)
"$py" - "$llama" "$ours" "$runs" "$threads" "$out" <<'PY'
import json, platform, sys
llama, ours, runs, threads, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
rows = [("decode tokens/s (64 new tokens)", llama["decode_tok_s"], ours["decode_tok_s"]),
        (f"prefill tokens/s ({ours['prompt_tokens']}-token chat prompt)", llama["prefill_tok_s"], ours["prefill_tok_s"])]
md = [f"# Decode and prefill speed: frspec vs llama.cpp (SmolLM2-135M-Instruct Q4_1 GGUF)", "",
      f"{cpu}, {threads} threads each, median of {runs} runs after one warm-up, measured in one run by",
      "`scripts/bench-vs-llamacpp.sh`.", "",
      "| | llama.cpp | frspec | frspec ÷ llama.cpp |", "|---|---:|---:|---:|"]
md += [f"| {name} | {l:.1f} | {o:.1f} | {o / l:.2f} |" for name, l, o in rows]
md += ["", f"frspec: a {ours['block']}-token block forward (verification, logits for every row) costs "
       f"{ours['block_cost_ratio']:.2f}× a one-token forward at the same position.", "",
       f"llama.cpp: llama-cpp-python {llama.get('llama_cpp_python_version', '?')}; frspec per-run decode tokens/s: "
       + ", ".join(f"{v:.1f}" for v in ours["decode_tok_s_runs"]) + "."]
open(f"{out}/decode-vs-llamacpp.md", "w").write("\n".join(md) + "\n")
json.dump({"llama_cpp": llama, "frspec": ours}, open(f"{out}/decode-vs-llamacpp.json", "w"), indent=1)
print("\n".join(md))
PY
