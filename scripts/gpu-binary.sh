# Sourced by the GPU scripts (gpu-check.sh, gpu-profile.sh), whose arguments are FRSPEC_BINARY[.xz] OUT_DIR: sets
# `out` (made), `work` (a scratch folder removed on exit), `bin` (a runnable frspec, unpacked into $work when it is
# gpu-build.sh's .xz) and the loader's path to the CUDA libraries it links, and stops the script when one is missing.
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
[ -x "$bin" ] || { echo "$0: $bin is not an executable" >&2; exit 2; }

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
  echo "$0: libraries not found:" >&2; ldd "$bin" | grep 'not found' >&2; exit 2
fi
