#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and no network, with a frspec built elsewhere by
#   eval "$(scripts/cuda-toolchain.sh)" && cargo build --release --features cuda
# Downloads nothing: every model is synthetic. Planned for about 2 minutes on one H200 (not yet timed there); at most 8.
#   1. agreement: greedy tokens of a synthetic model in f32 on the GPU against the CPU engine (exit 1 if they differ)
#   2. bench head at Llama-3.1 size (H 4096, V 128256) in bf16, B = 1 … 1024, every ratio
#   3. bench decode at Llama-3.1-8B shape in bf16 (random weights): target-only tokens/s and its share of the measured
#      memory bandwidth, a verification pass, an EAGLE-1 drafting step at each ratio
# Usage: scripts/gpu-check.sh FRSPEC_BINARY[.xz] OUT_DIR   (figures and logs go to OUT_DIR)
# scripts/gpu-build.sh makes .gpu/frspec.xz, small enough to travel to a GPU machine with the checkout.
set -euo pipefail

[ $# -eq 2 ] || { echo "usage: $0 FRSPEC_BINARY[.xz] OUT_DIR" >&2; exit 2; }
out=$2
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case $1 in
  *.xz) bin="$work/frspec"
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$bin"
        chmod +x "$bin" ;;
  *) bin=$(realpath "$1") ;;
esac
[ -x "$bin" ] || { echo "gpu-check: $bin is not an executable" >&2; exit 2; }

# candle links CUDA 13's runtime, cuBLAS, cuRAND and NVRTC dynamically. A CUDA install or the nvidia-* Python wheels
# (PyTorch's) provide them; add every folder that holds one to the loader's path.
libs=$( { ls -d /usr/local/cuda/lib64 2>/dev/null
          python3 -c 'import glob, os, site
for sp in site.getsitepackages():
    for so in glob.glob(os.path.join(sp, "nvidia", "**", "libcublas.so*"), recursive=True):
        print(os.path.dirname(so))' 2>/dev/null
          find /usr /opt -xdev \( -name 'libcublasLt.so.13*' -o -name 'libnvrtc.so.13*' -o -name 'libcurand.so.10*' -o -name 'libcudart.so.13*' \) \
            -printf '%h\n' 2>/dev/null; } | sort -u | paste -sd:)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ldd "$bin" | grep -q 'not found'; then
  echo "gpu-check: libraries not found:" >&2; ldd "$bin" | grep 'not found' >&2; exit 2
fi
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
"$bin" bench decode --shape llama31-8b --device cuda --dtype bf16 --new-tokens 128 --runs 3 --json | tee "$out/decode-llama31-8b.json"

exit $status
