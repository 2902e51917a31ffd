#!/usr/bin/env bash
# Where a decode step's time goes on an NVIDIA GPU: Nsight Compute (ncu) times every kernel of a short
# `bench decode --shape llama31-8b` in bf16 (random weights), and the summary adds them up per decode step by kernel,
# against the step's wall time that `bench decode` measures without the profiler (scripts/gpu-check.sh part 3): what
# the kernels take is device work, the rest of the step is gaps between kernels (launch, start, drain).
# Clocks and caches are left alone (--clock-control none --cache-control none), so each kernel runs as in a real
# step, one at a time.
# A second pass does the same for the batched speculative loop at B = 64 (issue 19): a step verifies 64 × 5 rows and
# drafts 4 positions of 64 rows; its kernels are summed per batched step (T = 0 and T = 1 together), beside the wall
# time a step takes without the profiler (part 3 of gpu-check.sh: 64 / its steps/s at B = 64).
# Usage: scripts/gpu-profile.sh FRSPEC_BINARY[.xz] OUT_DIR
#        (ncu.csv.gz, summary.txt, batched-ncu.csv.gz and batched-summary.txt go to OUT_DIR)
set -euo pipefail

. "$(dirname "$0")/gpu-binary.sh"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1) \
  || { echo "gpu-profile: ncu not found" >&2; exit 2; }

# Summaries of ncu's CSV, shared by both passes: `decode` sums one-token decode steps by kernel, `batched` the
# batched loop's steps.
cat > "$work/summarize.py" <<'PY'
import collections, csv, sys
def micros(r):
    try:
        return float(r.get("gpu__time_duration.sum", "").replace(",", "")) / 1e3
    except ValueError:
        return None
def grid_x(r):
    return int(r["Grid Size"].strip("()").split(",")[0])
def table(launches, n, total, limit=None):
    by = collections.defaultdict(lambda: [0, 0.0])
    for r in launches:
        key = (r["Kernel Name"].split("(")[0], r["Grid Size"], r["Block Size"])
        by[key][0] += 1
        by[key][1] += micros(r)
    print(f"{'kernel':<40} {'grid':>16} {'block':>14} {'a step':>7} {'us each':>9} {'us a step':>10} {'share':>7}")
    for (name, grid, block), (count, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:limit]:
        print(f"{name[:40]:<40} {grid:>16} {block:>14} {count / n:>7.1f} {us / count:>9.2f} {us / n:>10.1f} {100 * us / n / total:>6.1f}%")
mode, path = sys.argv[1], sys.argv[2]
rows = [r for r in csv.DictReader(l for l in open(path) if not l.startswith("==")) if r.get("Kernel Name") and micros(r) is not None]
print(f"{len(rows)} kernels timed")
if mode == "decode":
    # A decode step is what runs between two one-row LM-head products: the matrix-vector launches with the largest
    # grid (the head has the most rows). A one-token step launches the same kernels every time: keep the stretches of
    # the most common length (a prefill or the bench's other passes launch others), from the second, timed run.
    head_grid = max(grid_x(r) for r in rows if r["Kernel Name"].startswith("matvec"))
    heads = [i for i, r in enumerate(rows) if r["Kernel Name"].startswith("matvec") and grid_x(r) == head_grid]
    lengths = collections.Counter(b - a for a, b in zip(heads, heads[1:]))
    steps = [(a, b) for a, b in zip(heads, heads[1:]) if b - a == lengths.most_common(1)[0][0]]
    steps = steps[len(steps) // 2:]
    launches = [r for a, b in steps for r in rows[a + 1:b + 1]]
    n = max(len(steps), 1)
    total = sum(micros(r) for r in launches) / n
    print(f"{len(steps)} decode steps; kernels a step {len(launches) / n:.0f}, their time {total:.1f} us a step (mean)")
    table(launches, n, total)
else:
    # The loop's first verification is the first attention launch over more rows than any launch before it (the
    # 64-token block: 64 × 32 heads blocks); the window starts after the attention launch before it.
    layers, heads, verify_rows = 32, 32, 64 * 5
    attention = [i for i, r in enumerate(rows) if r["Kernel Name"].startswith("rows_attention")]
    big = [i for i in attention if grid_x(rows[i]) > 64 * heads]
    if not big:
        sys.exit("no attention launch of the batched loop among them")
    before = [i for i in attention if i < big[0]]
    start = before[-1] + 1 if before else 0
    launches = rows[start:]
    steps = sum(1 for r in launches if r["Kernel Name"].startswith("rows_attention") and grid_x(r) == verify_rows * heads) / layers
    n = max(steps, 1)
    total = sum(micros(r) for r in launches) / n
    print(f"the batched loop from launch {start}: {len(launches)} launches, {steps:.1f} verifications of {verify_rows} rows")
    print(f"kernels a batched step {len(launches) / n:.0f}, their time {total:.1f} us a step (mean; the turns' prefills included)")
    table(launches, n, total, 40)
PY

# Two runs of 16 decode steps after a 128-token prompt (the first run warms up); the profiler stops timing after the
# launches these take (the random weights, the bandwidth probe and the rest of the bench run untimed).
"$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-count "${FRSPEC_PROFILE_LAUNCHES:-12000}" --log-file "$work/ncu.csv" \
  "$bin" bench decode --shape llama31-8b --device cuda --dtype bf16 --new-tokens 16 --runs 1 --ratios 0 --batches 1 \
  --json > "$work/bench.json"
gzip -c "$work/ncu.csv" > "$out/ncu.csv.gz"
python3 "$work/summarize.py" decode "$work/ncu.csv" | tee "$out/summary.txt"

# The batched pass: 4 new tokens a turn and a 32-token prompt keep the launches before the loop few (the single-row
# parts run too, about 10,000 launches).
"$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-count "${FRSPEC_PROFILE_BATCHED_LAUNCHES:-20000}" --log-file "$work/batched-ncu.csv" \
  "$bin" bench decode --shape llama31-8b --device cuda --dtype bf16 --new-tokens 4 --runs 1 --ratios 0 --batches 64 \
  --prompt-tokens 32 --json > "$work/batched-bench.json"
gzip -c "$work/batched-ncu.csv" > "$out/batched-ncu.csv.gz"
python3 "$work/summarize.py" batched "$work/batched-ncu.csv" | tee "$out/batched-summary.txt"
