#!/usr/bin/env python3
"""A frequency file whose most frequent ids are an EAGLE-3 head's draft vocabulary (the target ids its d2t maps to),
so that any other draft can be swept with exactly that keep set: `frspec sweep --freq FILE --keeps <draft vocab size>`.
It answers how much the draft vocabulary itself costs, apart from the head that drafts over it. Python's standard
library only.

  scripts/draft_vocab_freq.py HEAD_FOLDER OUT.safetensors

HEAD_FOLDER holds config.json and model.safetensors with d2t, as train-eagle exports heads; a packed head
(model.gguf, as heads/ ship) is unpacked first by `frspec train-eagle --arch eagle3 --init-from HEAD --steps 0 ...`.
The draft ids come first (count 1, in id order), then every other id (count 0).
"""
import json
import pathlib
import struct
import sys


def d2t_offsets(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if "d2t" not in header:
        sys.exit(f"{path}: no d2t tensor (not an EAGLE-3 head)")
    entry = header["d2t"]
    if entry["dtype"] != "I64":
        sys.exit(f"{path}: d2t is {entry['dtype']}, expected I64")
    start, end = (8 + length + o for o in entry["data_offsets"])
    return struct.unpack(f"<{(end - start) // 8}q", data[start:end])


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    head, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    vocab = json.loads((head / "config.json").read_text())["vocab_size"]
    draft = [i + offset for i, offset in enumerate(d2t_offsets(head / "model.safetensors"))]
    if len(set(draft)) != len(draft) or not all(0 <= t < vocab for t in draft):
        sys.exit(f"{head}: d2t maps to repeated ids or ids outside the vocabulary of {vocab}")
    chosen = set(draft)
    ids = draft + [t for t in range(vocab) if t not in chosen]
    counts = [1] * len(draft) + [0] * (vocab - len(draft))
    header = {
        "ids": {"dtype": "I64", "shape": [vocab], "data_offsets": [0, 8 * vocab]},
        "counts": {"dtype": "I64", "shape": [vocab], "data_offsets": [8 * vocab, 16 * vocab]},
        "__metadata__": {"corpus": f"the draft vocabulary of {head}", "vocab_size": str(vocab)},
    }
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    out.write_bytes(struct.pack("<Q", len(encoded)) + encoded + struct.pack(f"<{vocab}q", *ids) + struct.pack(f"<{vocab}q", *counts))
    print(f"{len(draft)} draft ids of {vocab} -> {out}")


if __name__ == "__main__":
    main()
