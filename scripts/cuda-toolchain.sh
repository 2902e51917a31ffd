#!/usr/bin/env bash
# A CUDA 13.0 toolkit for `cargo build --features cuda` on a machine with no GPU and no CUDA install, made from
# NVIDIA's wheels on PyPI (scripts/cuda-requirements.txt, pinned by sha256): nvcc, cicc, the headers, and the
# libraries candle links against. The one piece no wheel carries is the driver, libcuda.so; like the toolkit's own
# lib/stubs/libcuda.so, a stub exporting the driver API's names (read from cuda.h) stands in at link time, and the
# real driver is found at run time on a GPU machine.
#
# Usage: eval "$(scripts/cuda-toolchain.sh)" && cargo build --release --features cuda
# Prints the exports; CUDA_COMPUTE_CAP defaults to 90 (H100/H200), set it before to build for another GPU.
# Cache: $FRSPEC_CACHE/cuda-13.0 (default ~/.cache/frspec); nothing is fetched when it is complete already.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
requirements="$here/cuda-requirements.txt"
cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
root="$cache/cuda-13.0"
stamp="$root/.complete"
want=$(sha256sum "$requirements" | cut -d' ' -f1)

die() { echo "cuda-toolchain: $*" >&2; exit 1; }

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  command -v python3 >/dev/null || die "python3 is needed to fetch the CUDA wheels"
  command -v gcc >/dev/null || die "gcc is needed: nvcc uses it as host compiler, and it builds the driver stub"
  dl="$cache/.dl/cuda-13.0"
  rm -rf "$root" "$dl" && mkdir -p "$root" "$dl"
  echo "cuda-toolchain: fetching the CUDA 13.0 wheels (about 700 MB) into $root" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes -r "$requirements" -d "$dl" >&2 \
    || die "pip could not download the CUDA wheels (is PyPI reachable?)"
  # Every wheel holds one piece of the toolkit under nvidia/cu13/; unpacked together they form the usual layout
  # (bin, include, lib, nvvm). zipfile keeps no file modes, so they are restored from the archive.
  python3 - "$root" "$dl"/*.whl <<'EOF'
import os, sys, zipfile
root, wheels = sys.argv[1], sys.argv[2:]
prefix = "nvidia/cu13/"
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if not member.filename.startswith(prefix) or member.is_dir():
                continue
            target = os.path.join(root, member.filename[len(prefix):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with archive.open(member) as source, open(target, "wb") as sink:
                sink.write(source.read())
            mode = member.external_attr >> 16
            if mode:
                os.chmod(target, mode & 0o777)
EOF
  # The linker looks for libNAME.so; the wheels carry only the versioned names.
  for lib in "$root"/lib/lib*.so.*; do
    ln -sf "$(basename "$lib")" "${lib%%.so.*}.so"
  done
  # Stub driver: every cu* function cuda.h declares, under both its current and its versioned legacy names.
  mkdir -p "$root/lib/stubs"
  { gcc -E -P -I"$root/include" -x c "$root/include/cuda.h"
    gcc -E -P -D__CUDA_API_VERSION_INTERNAL -I"$root/include" -x c "$root/include/cuda.h"; } \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u \
    | sed 's/.*/void &(void) {}/' >"$root/lib/stubs/libcuda.c"
  [ -s "$root/lib/stubs/libcuda.c" ] || die "no driver functions found in $root/include/cuda.h"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/libcuda.c"
  "$root/bin/nvcc" --version >/dev/null || die "the unpacked nvcc does not run"
  rm -rf "$dl"
  echo "$want" >"$stamp"
fi

echo "export CUDA_HOME='$root'"
echo "export PATH='$root/bin':\"\$PATH\""
echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
