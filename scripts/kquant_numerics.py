#!/usr/bin/env python3
"""How far each engine's logits on a K-quant GGUF lie from the exact product of its dequantized weights.

Why: frspec's K-quant kernels take 8-bit (Q8_K) activations by default, as llama.cpp does, or f32 activations
(FRSPEC_ACTIVATIONS=f32). This puts a number on what the 8-bit activations cost, next to what they cost
llama.cpp on the same file: the file's f32 twin (every tensor dequantized, written as f32, scored by frspec in f32)
is the reference, and every engine scores the same fixed token sequence (the first 400 tokens of the MT-Bench first
turns as llama.cpp tokenizes them for SmolLM2, datasets/fixtures/), position by position.

Usage (venv of scripts/setup-numerics-env.sh; the model from scripts/make_kquant_model.py):
    ~/.cache/frspec-py/bin/python scripts/kquant_numerics.py --frspec FRSPEC_BINARY [--model GGUF]
Writes results/numerics/kquants.{md,json}.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_kquant_model import CACHE, WIDTH, write_f32  # noqa: E402

DEFAULT_MODEL = CACHE / "smollm2" / f"SmolLM2-135M-Instruct-d{WIDTH}.Q4_K_M.gguf"
FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "mtbench_smollm2_llamacpp_tokens.json"


def frspec_logits(frspec: str, model: Path, tokens: Path, activations: str, out: Path) -> np.ndarray:
    subprocess.run([frspec, "score", "--model", str(model), "--tokens-file", str(tokens), "--json", "--logits-out", str(out)],
                   check=True, stdout=subprocess.DEVNULL, env={**os.environ, "FRSPEC_ACTIVATIONS": activations})
    return np.load(out)


def llamacpp_logits(model: Path, ids: list[int], threads: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=512, n_batch=512, n_threads=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(a: np.ndarray, b: np.ndarray, n: int) -> dict:
    d = np.abs(a[:n] - b[:n])
    return {"top1_agree": int((a[:n].argmax(1) == b[:n].argmax(1)).sum()), "positions": n,
            "max_abs_logit_diff": float(d.max()), "mean_abs_logit_diff": float(d.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frspec", required=True)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/numerics"))
    args = ap.parse_args()
    fixture = json.loads(FIXTURE.read_text())
    ids = [t for q in fixture["questions"] for t in q["turns"][0]][:args.tokens]
    n = len(ids) - 1  # the last position predicts past the sequence
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.json"
        tokens.write_text(json.dumps(ids))
        twin = tmp / "twin.gguf"
        write_f32(args.model, twin)
        reference = frspec_logits(args.frspec, twin, tokens, "f32", tmp / "twin.npy")
        engines = {
            "frspec, Q8_K activations (default)": frspec_logits(args.frspec, args.model, tokens, "q8", tmp / "q8.npy"),
            "frspec, f32 activations": frspec_logits(args.frspec, args.model, tokens, "f32", tmp / "f32.npy"),
            f"llama.cpp (llama-cpp-python {md.version('llama_cpp_python')})": llamacpp_logits(args.model, ids, args.threads),
        }
    rows = {name: compare(logits, reference, n) for name, logits in engines.items()}
    digest = hashlib.sha256(args.model.read_bytes()).hexdigest()
    md_lines = [f"# K-quant numerics: each engine against the f32 twin ({args.model.name})", "",
                f"sha256 of the file: `{digest}`. Reference: every tensor of the file dequantized to f32 and scored by",
                f"frspec in f32. Teacher-forced along {len(ids)} tokens (MT-Bench first turns, `{FIXTURE.name}`), "
                f"{n} positions. Made by `scripts/kquant_numerics.py`.", "",
                "| engine | top-1 agree | max \\|Δlogit\\| | mean \\|Δlogit\\| |", "|---|---:|---:|---:|"]
    md_lines += [f"| {name} | {r['top1_agree']}/{r['positions']} ({100 * r['top1_agree'] / r['positions']:.1f}%) | "
                 f"{r['max_abs_logit_diff']:.2e} | {r['mean_abs_logit_diff']:.2e} |" for name, r in rows.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kquants.md").write_text("\n".join(md_lines) + "\n")
    (args.out / "kquants.json").write_text(json.dumps({"model": args.model.name, "sha256": digest, "engines": rows}, indent=1) + "\n")
    print("\n".join(md_lines))


if __name__ == "__main__":
    main()
