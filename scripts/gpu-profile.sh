#!/usr/bin/env bash
# Where a decode step's time goes on an NVIDIA GPU: Nsight Compute (ncu) times every kernel of a short
# `bench decode --shape llama31-8b` in bf16 (random weights), and the summary adds them up per decode step by kernel,
# against the step's wall time that `bench decode` measures without the profiler (scripts/gpu-check.sh part 3): what
# the kernels take is device work, the rest of the step is gaps between kernels (launch, start, drain).
# Clocks and caches are left alone (--clock-control none --cache-control none), so each kernel runs as in a real
# step, one at a time.
# Usage: scripts/gpu-profile.sh FRSPEC_BINARY[.xz] OUT_DIR   (ncu.csv.gz and summary.txt go to OUT_DIR)
set -euo pipefail

. "$(dirname "$0")/gpu-binary.sh"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1) \
  || { echo "gpu-profile: ncu not found" >&2; exit 2; }

# Two runs of 16 decode steps after a 128-token prompt (the first run warms up); the profiler stops timing after the
# launches these take (the random weights, the bandwidth probe and the rest of the bench run untimed).
"$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-count "${FRSPEC_PROFILE_LAUNCHES:-12000}" --log-file "$work/ncu.csv" \
  "$bin" bench decode --shape llama31-8b --device cuda --dtype bf16 --new-tokens 16 --runs 1 --ratios 0 --batches 1 \
  --json > "$work/bench.json"
gzip -c "$work/ncu.csv" > "$out/ncu.csv.gz"
python3 - "$work/ncu.csv" <<'PY' | tee "$out/summary.txt"
import collections, csv, sys
def micros(r):
    try:
        return float(r.get("gpu__time_duration.sum", "").replace(",", "")) / 1e3
    except ValueError:
        return None
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("==")) if r.get("Kernel Name") and micros(r) is not None]
# A decode step is what runs between two one-row LM-head products: the matrix-vector launches with the largest grid
# (the head has the most rows).
def grid_x(r):
    return int(r["Grid Size"].strip("()").split(",")[0])
head_grid = max(grid_x(r) for r in rows if r["Kernel Name"].startswith("matvec"))
heads = [i for i, r in enumerate(rows) if r["Kernel Name"].startswith("matvec") and grid_x(r) == head_grid]
print(f"{len(rows)} kernels timed")
by = collections.defaultdict(lambda: [0, 0.0])
# A one-token step launches the same kernels every time: keep the stretches of the most common length (a prefill or
# the bench's other passes launch others), from the second, timed run.
lengths = collections.Counter(b - a for a, b in zip(heads, heads[1:]))
steps = [(a, b) for a, b in zip(heads, heads[1:]) if b - a == lengths.most_common(1)[0][0]]
steps = steps[len(steps) // 2:]
for a, b in steps:
    for r in rows[a + 1:b + 1]:
        key = (r["Kernel Name"].split("(")[0], r["Grid Size"], r["Block Size"])
        by[key][0] += 1
        by[key][1] += micros(r)
n = max(len(steps), 1)
total = sum(v[1] for v in by.values()) / n
print(f"{len(steps)} decode steps; kernels a step {sum(v[0] for v in by.values()) / n:.0f}, their time {total:.1f} us a step (mean)")
print(f"{'kernel':<40} {'grid':>16} {'block':>14} {'a step':>7} {'us each':>9} {'us a step':>10} {'share':>7}")
for (name, grid, block), (count, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:40]:<40} {grid:>16} {block:>14} {count / n:>7.0f} {us / count:>9.2f} {us / n:>10.1f} {100 * us / n / total:>6.1f}%")
PY
