#!/usr/bin/env python3
"""llama.cpp speed on the SmolLM2 GGUF, as a yardstick for `frspec bench` (same model, machine and threads).

Why: frspec's decode / prefill tokens/s only mean something next to a known-good engine on the same model file,
machine and thread count. This measures llama.cpp through llama-cpp-python with a minimal Python loop (argmax over
the raw logits, no sampler chain), so the figures are llama.cpp's, not the bindings' sampling overhead.

Protocol: the chat prompt for --question (rendered with the GGUF's own chat template, default system prompt,
generation prompt; no extra BOS) is prefilled from an empty context (reset every run) and timed: prefill tok/s =
prompt tokens / time. Then --new-tokens greedy tokens are decoded one at a time, ignoring end-of-turn (like
llama-bench's tg): decode tok/s = new tokens / time of those single-token evaluations. One warm-up run, then the
median of --runs runs (and the best run). Optionally (--hf) the same greedy decode with HF transformers in f32.

Run it one after the other with `frspec bench`, never at the same time, on an otherwise idle machine: with 2 threads
on 2 cores, any other busy process (a cargo build) cuts llama.cpp's decode rate by 10-30x in some runs.
--wait-idle waits for that; the JSON records the CPU use seen just before (cpu_busy_before) and the load average.

Prints one JSON object on stdout; progress goes to stderr. Run in the venv made by scripts/setup-numerics-env.sh:
    ~/.cache/frspec-py/bin/python scripts/bench_llamacpp.py [--threads 2] [--runs 5] [--hf] [--wait-idle 300]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("FRSPEC_CACHE", Path.home() / ".cache" / "frspec"))
DEFAULT_MODEL = CACHE / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def render_chat(template: str, question: str) -> str:
    """Render the GGUF's chat template (Jinja) for one user turn with the generation prompt."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(messages=[{"role": "user", "content": question}],
                                            add_generation_prompt=True)


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval` seconds (from /proc/stat), i.e. what other processes use."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(interval)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(max_wait: float, threshold: float = 0.10) -> float:
    """Wait up to max_wait seconds for the machine to be idle (busy < threshold); return the last busy fraction."""
    deadline = time.time() + max_wait
    busy = cpu_busy()
    while busy >= threshold and time.time() < deadline:
        busy = cpu_busy(2.0)
    return busy


def bench_llamacpp(model: Path, question: str, threads: int, new_tokens: int, runs: int,
                   flash_attn: bool = False) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                logits_all=False, flash_attn=flash_attn, verbose=False)
    prompt = render_chat(llm.metadata["tokenizer.chat_template"], question)
    # The template begins with <|im_start|> (= the GGUF's BOS id 1): tokenize as is, special tokens parsed.
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # only the last position is an output when logits_all=False
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def one_run() -> dict:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        nxt = int(np.argmax(last_logits()))
        t1 = time.perf_counter()
        out = [nxt]
        for _ in range(new_tokens):
            llm.eval([nxt])
            nxt = int(np.argmax(last_logits()))
            out.append(nxt)
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_tok_s": len(ids) / (t1 - t0),
                "decode_tok_s": new_tokens / (t2 - t1), "tokens": out[:new_tokens]}

    one_run()  # warm-up
    results = [one_run() for _ in range(runs)]
    text = llm.detokenize(results[0]["tokens"][:16]).decode("utf-8", "replace")
    for r in results:
        del r["tokens"]
    return {"engine": f"llama.cpp (llama-cpp-python {md.version('llama_cpp_python')})", "model_file": model.name,
            "llama_cpp_python_version": md.version("llama_cpp_python"),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in results),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in results),
            # best run: the least disturbed by other processes (2 spinning threads on 2 cores collapse under load)
            "decode_tok_s_best": max(r["decode_tok_s"] for r in results),
            "prefill_tok_s_best": max(r["prefill_tok_s"] for r in results),
            "prompt_tokens": len(ids), "new_tokens": new_tokens, "threads": threads, "flash_attn": flash_attn,
            "first_tokens_text": text, "runs": [{k: round(v, 4) for k, v in r.items()} for r in results]}


def bench_hf(model: Path, question: str, threads: int, new_tokens: int, runs: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    m = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    # transformers 5.2x renamed the KV-cache argument / output field `past_key_values` to `cache`
    cache_kw = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"

    def one_run() -> dict:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = m(ids, use_cache=True)
            past, nxt = getattr(out, cache_kw), out.logits[0, -1].argmax()
            t1 = time.perf_counter()
            for _ in range(new_tokens):
                out = m(nxt.view(1, 1), use_cache=True, **{cache_kw: past})
                past, nxt = getattr(out, cache_kw), out.logits[0, -1].argmax()
            t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_tok_s": ids.shape[1] / (t1 - t0),
                "decode_tok_s": new_tokens / (t2 - t1)}

    one_run()
    results = [one_run() for _ in range(runs)]
    return {"engine": f"HF transformers {md.version('transformers')} f32 (torch {md.version('torch')})",
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in results),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in results),
            "decode_tok_s_best": max(r["decode_tok_s"] for r in results),
            "prompt_tokens": int(ids.shape[1]), "runs": [{k: round(v, 4) for k, v in r.items()} for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention (off by default)")
    ap.add_argument("--hf", action="store_true", help="also measure HF transformers f32 (slow to load)")
    ap.add_argument("--hf-runs", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="first wait up to this long for other processes' CPU use to drop below 10%%")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    busy_before = wait_idle(args.wait_idle) if args.wait_idle > 0 else cpu_busy()
    t = time.time()
    res = bench_llamacpp(args.model, args.question, args.threads, args.new_tokens, args.runs, args.flash_attn)
    print(f"llama.cpp: decode {res['decode_tok_s']:.1f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s "
          f"({time.time() - t:.0f}s)", file=sys.stderr)
    if args.hf:
        res["hf"] = bench_hf(args.model, args.question, args.threads, args.new_tokens, args.hf_runs)
        print(f"HF f32: decode {res['hf']['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    # Another busy process skews the figures badly (2 threads on 2 cores): keep the evidence with the result.
    res["cpu_busy_before"] = round(busy_before, 3)
    res["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
