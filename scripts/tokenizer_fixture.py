#!/usr/bin/env python3
"""Write the tokenizer fixture datasets/fixtures/mtbench_smollm2_llamacpp_tokens.json.

Why: frspec builds SmolLM2's GPT-2-style BPE tokenizer itself from the GGUF metadata; its tests need ground-truth
ids for real text. This tokenizes every turn of all 80 MT-Bench questions with llama.cpp (llama-cpp-python,
vocab only, add_bos=False, special=False) and stores token ids only (no question text: tests read the text from
question.jsonl, whose sha256 is recorded). It also checks that HF transformers' GGUF tokenizer gives the same ids
and reports any difference.

Run in the venv made by scripts/setup-numerics-env.sh, from the repo root:
    ~/.cache/frspec-py/bin/python scripts/tokenizer_fixture.py [--no-hf-check]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

CACHE = Path(os.environ.get("FRSPEC_CACHE", Path.home() / ".cache" / "frspec"))
DEFAULT_MODEL = CACHE / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_QUESTIONS = CACHE / "mt_bench" / "question.jsonl"
DEFAULT_OUT = Path("datasets/fixtures/mtbench_smollm2_llamacpp_tokens.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-hf-check", action="store_true", help="skip the HF transformers cross-check")
    args = ap.parse_args()

    from llama_cpp import Llama

    raw = args.questions.read_bytes()
    questions = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    llm = Llama(model_path=str(args.model), vocab_only=True, verbose=False)
    fixture = {
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "tokenizer": f"llama.cpp (llama-cpp-python {md.version('llama_cpp_python')}) on {args.model.name}",
        "questions": [{"question_id": q["question_id"],
                       "turns": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in q["turns"]]}
                      for q in questions],
    }
    n_turns = sum(len(q["turns"]) for q in fixture["questions"])
    n_tokens = sum(len(t) for q in fixture["questions"] for t in q["turns"])
    print(f"llama.cpp: {len(questions)} questions, {n_turns} turns, {n_tokens} tokens", file=sys.stderr)

    if not args.no_hf_check:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
        diffs = []
        for q, fq in zip(questions, fixture["questions"]):
            for k, (text, ids) in enumerate(zip(q["turns"], fq["turns"])):
                hf_ids = tok(text, add_special_tokens=False)["input_ids"]
                if hf_ids != ids:
                    first = next((i for i, (x, y) in enumerate(zip(hf_ids, ids)) if x != y), min(len(hf_ids), len(ids)))
                    diffs.append({"question_id": q["question_id"], "turn": k + 1, "first_diff_at": first,
                                  "llamacpp": ids[max(0, first - 2): first + 4],
                                  "hf": hf_ids[max(0, first - 2): first + 4]})
        print(f"HF transformers {md.version('transformers')} (tokenizers {md.version('tokenizers')}) GGUF tokenizer: "
              f"{n_turns - len(diffs)}/{n_turns} turns identical", file=sys.stderr)
        for d in diffs:
            print(f"  differs: {json.dumps(d)}", file=sys.stderr)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    # one question per line: small diffs when regenerated, still plain JSON
    body = ",\n".join("  " + json.dumps(q, separators=(",", ":")) for q in fixture["questions"])
    head = json.dumps({k: fixture[k] for k in ("source_sha256", "tokenizer")}, indent=1)[:-2]
    args.out.write_text(f'{head},\n "questions": [\n{body}\n ]\n}}\n')
    json.loads(args.out.read_text())  # sanity: valid JSON
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
