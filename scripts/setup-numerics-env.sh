#!/usr/bin/env bash
# Create (or bring up to date) the Python virtualenv that the numerics and speed comparisons run in
# (scripts/numerics.py, scripts/tokenizer_fixture.py, scripts/bench_llamacpp.py). It lives outside the repo.
# Usage: scripts/setup-numerics-env.sh        venv: $FRSPEC_PY, default ~/.cache/frspec-py
# Idempotent: pinned packages already present are left alone (llama-cpp-python is not rebuilt).
#
# Why torch is installed the way it is: PyPI's only linux x86_64 torch wheel is the CUDA build, and the
# pytorch.org CPU index is not reachable here. `pip install torch --no-deps` alone does NOT import
# (libtorch_cpu.so / libtorch_python.so have hard NEEDED entries on libcudart, libcupti, libcudnn, libcublas, ...),
# so this script installs the wheel with --no-deps, then its declared dependencies from the wheel's own metadata
# minus triton and cuda-bindings (only used by torch.compile / CUDA kernels). The nvidia-* runtime libraries that
# remain are ~3 GB on disk but download and install in ~30 s; nothing here uses a GPU.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements-numerics.txt"
venv="${FRSPEC_PY:-$HOME/.cache/frspec-py}"
py="$venv/bin/python"

die() { echo "setup-numerics-env: $*" >&2; exit 1; }
[ -f "$req" ] || die "missing $req"
torch_spec=$(sed -n 's/^# *no-deps: *\(torch==[^ ]*\).*/\1/p' "$req")
[ -n "$torch_spec" ] || die "no '# no-deps: torch==VERSION' line in $req"

if [ ! -x "$py" ]; then
  echo "creating venv $venv"
  python3 -m venv "$venv"
fi
pip() { "$py" -m pip --disable-pip-version-check "$@"; }
pip install -q packaging

# 1. torch without its dependency closure, then the dependencies it needs to import.
if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '${torch_spec#torch==}')" 2>/dev/null; then
  echo "installing $torch_spec (--no-deps)"
  pip install -q --no-deps "$torch_spec"
fi
mapfile -t torch_deps < <("$py" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
SKIP = {"triton", "cuda-bindings"}  # torch.compile / CUDA-only; not needed to import or run on CPU
for r in md.requires("torch") or []:
    req = Requirement(r)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req))
EOF
)
echo "installing torch's runtime deps: ${torch_deps[*]}"
echo "(pip may report that torch requires triton / cuda-bindings: expected, they are left out on purpose)"
pip install -q "${torch_deps[@]}"
"$py" -W ignore -c "import torch; torch.ones(2) @ torch.ones(2)" || die "torch does not import"

# 2. Everything else, pinned. llama-cpp-python builds llama.cpp from source (CMake comes from PyPI through
#    scikit-build-core): plain CPU build, tuned for this machine's CPU (GGML_NATIVE), no network fetches.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
pip install -q -r "$req"

"$py" - <<'EOF'
import importlib.metadata as md
import llama_cpp, torch, transformers  # noqa: F401  (import check)
print("numerics env ok:", ", ".join(f"{p} {md.version(p)}" for p in
      ["torch", "transformers", "tokenizers", "gguf", "accelerate", "numpy", "llama_cpp_python"]))
EOF
echo "venv: $venv  (activate: . $venv/bin/activate)"
