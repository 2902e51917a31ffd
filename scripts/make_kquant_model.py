#!/usr/bin/env python3
"""A real Q4_K_M GGUF made here: SmolLM2-135M-Instruct widened to d = 768, quantized by llama.cpp's own quantizer.

Why widen: K-quant super-blocks hold 256 values of a row, and SmolLM2's hidden size 576 is not a multiple of 256, so
llama.cpp's quantize falls back to Q5_0/Q5_1/Q8_0 for every matrix but ffn_down: its "Q4_K_M" of SmolLM2 is hardly a
K-quant file. The widened model computes the same function with every row a whole number of super-blocks:
- the residual stream gets 192 dimensions that stay zero (zero columns in every input projection and the embedding,
  zero rows in every output projection);
- 9 heads become 12: a zero query head after every three, so with 3 KV heads each group of 4 query heads holds the
  3 original heads of that group (GQA maps head h to KV head h // 4) and one whose output projection columns are zero;
- RMSNorm divides by the mean over 768 values instead of 576: the norm weights are multiplied by sqrt(576/768) and
  eps by 576/768, which gives back the original normalization exactly (in real numbers).
The script checks that claim with llama.cpp itself (the widened f32 model's greedy tokens and logits against the
original's), then writes Q4_K_M with llama_model_quantize (llama-cpp-python, pinned in
scripts/requirements-numerics.txt) and prints the tensor types it chose.

Usage (venv of scripts/setup-numerics-env.sh):
    ~/.cache/frspec-py/bin/python scripts/make_kquant_model.py [--out-dir DIR] [--ftype Q4_K_M]
Writes DIR/SmolLM2-135M-Instruct-d768.f32.gguf and DIR/SmolLM2-135M-Instruct-d768.<FTYPE>.gguf
(DIR defaults to $FRSPEC_CACHE/smollm2); prints the quantized file's path last.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("FRSPEC_CACHE", Path.home() / ".cache" / "frspec"))
SOURCE = CACHE / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WIDTH = 768
# llama.h's llama_ftype values for the mixes this script offers.
FTYPES = {"Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18}


def widen(name: str, w: np.ndarray, hidden: int, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """Tensor `name` (numpy order: [out, in] for matrices) of the widened model."""
    group = heads // kv_heads
    new_group = group + 1

    def head_slots(rows: np.ndarray) -> np.ndarray:
        """[heads·head_dim, ...] -> [(heads + kv_heads)·head_dim, ...], a zero head after each group."""
        out = np.zeros((WIDTH,) + rows.shape[1:], dtype=np.float32)
        for h in range(heads):
            g, i = divmod(h, group)
            new = g * new_group + i
            out[new * head_dim:(new + 1) * head_dim] = rows[h * head_dim:(h + 1) * head_dim]
        return out

    def pad_in(m: np.ndarray) -> np.ndarray:
        return np.pad(m, ((0, 0), (0, WIDTH - hidden)))

    def pad_out(m: np.ndarray) -> np.ndarray:
        return np.pad(m, ((0, WIDTH - hidden), (0, 0)))

    kind = name.split(".")[-2]
    if w.ndim == 1:  # RMSNorm weights
        return np.pad(w * np.float32(np.sqrt(hidden / WIDTH)), (0, WIDTH - hidden))
    if kind == "attn_q":
        return pad_in(head_slots(w))
    if kind == "attn_output":
        return pad_out(head_slots(w.T).T)
    if kind in ("token_embd", "output", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
        return pad_in(w)
    if kind == "ffn_down":
        return pad_out(w)
    raise SystemExit(f"{name}: no rule to widen this tensor")


def rewrite_gguf(source: Path, out: Path, metadata: dict, tensor) -> None:
    """`source` written to `out` as f32 tensors: every metadata field copied (`metadata` overrides values), every
    tensor dequantized and passed through `tensor(name, values)`."""
    import gguf

    r = gguf.GGUFReader(source)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, metadata.get(key, field.contents()), vtype, sub_type=sub)
    for t in r.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, np.ascontiguousarray(tensor(t.name, values)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f32(source: Path, out: Path) -> None:
    """`source` with every tensor dequantized to f32 (its "twin")."""
    rewrite_gguf(source, out, {"general.file_type": 0}, lambda name, values: values)


def write_widened(source: Path, out: Path) -> None:
    import gguf

    meta = {k: f.contents() for k, f in gguf.GGUFReader(source).fields.items() if not k.startswith("GGUF.")}
    arch = meta["general.architecture"]
    hidden, heads, kv_heads = (int(meta[f"{arch}.{k}"]) for k in ("embedding_length", "attention.head_count", "attention.head_count_kv"))
    head_dim = hidden // heads
    if hidden % heads or heads % kv_heads or heads + kv_heads != WIDTH // head_dim:
        raise SystemExit(f"{source}: d={hidden}, {heads} heads / {kv_heads} KV heads do not widen to {WIDTH} this way")
    changed = {
        f"{arch}.embedding_length": WIDTH,
        f"{arch}.attention.head_count": heads + kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]) * hidden / WIDTH,
        "general.file_type": 0,  # all f32
        "general.name": f"{meta.get('general.name', 'SmolLM2')} widened to d={WIDTH}",
    }
    rewrite_gguf(source, out, changed, lambda name, values: widen(name, values, hidden, heads, kv_heads, head_dim))


def check_same_function(original: Path, widened: Path, prompt: str, new_tokens: int) -> dict:
    """Greedy tokens and logits along them of two f32 models under llama.cpp."""
    from llama_cpp import Llama

    def run(path: Path) -> tuple[list[int], np.ndarray]:
        # An f32 KV cache: llama.cpp keeps it in f16 by default, which alone moves these logits by ≈ 0.03.
        llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=False, type_k=0, type_v=0)
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.eval(ids)
        out, logits = [], []
        for _ in range(new_tokens):
            row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
            logits.append(row)
            out.append(int(np.argmax(row)))
            llm.eval([out[-1]])
        return out, np.array(logits)

    a, la = run(original)
    b, lb = run(widened)
    same = sum(x == y for x, y in zip(a, b))
    worst = float(np.abs(la - lb).max())
    return {"tokens": new_tokens, "same_tokens": same, "max_logit_difference": worst}


def quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = os.cpu_count() or 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst} failed ({rc})")


def census(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    counts = collections.Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2)
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--out-dir", type=Path, default=CACHE / "smollm2")
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="Q4_K_M")
    args = ap.parse_args()
    import importlib.metadata as md

    args.out_dir.mkdir(parents=True, exist_ok=True)
    wide = args.out_dir / f"SmolLM2-135M-Instruct-d{WIDTH}.f32.gguf"
    quant = args.out_dir / f"SmolLM2-135M-Instruct-d{WIDTH}.{args.ftype}.gguf"
    write_widened(args.source, wide)
    # Against the original in f32 too: llama.cpp runs a Q4_1 file with 8-bit activations, which moves its logits by
    # up to ≈ 1.4 on its own.
    original = args.out_dir / "SmolLM2-135M-Instruct.f32.gguf"
    write_f32(args.source, original)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    same = check_same_function(original, wide, prompt, 32)
    original.unlink()
    print(f"widened f32 vs original f32 under llama.cpp: {json.dumps(same)}", file=sys.stderr)
    if same["same_tokens"] != same["tokens"] or same["max_logit_difference"] > 1e-2:
        raise SystemExit("the widened model does not compute what the original does")
    quantize(wide, quant, args.ftype)
    print(f"{quant.name}: {quant.stat().st_size} bytes, matrices {json.dumps(census(quant))}, "
          f"quantized by llama.cpp (llama-cpp-python {md.version('llama_cpp_python')})", file=sys.stderr)
    print(quant)


if __name__ == "__main__":
    main()
