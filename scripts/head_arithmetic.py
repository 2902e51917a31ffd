#!/usr/bin/env python3
"""EAGLE-3 heads made from other heads without training, to ask what a head would gain from them (issue 21;
results/train/smollm2-135m-eagle3.md, "Heads made without training"). Runs in the numerics venv
(scripts/setup-numerics-env.sh) or any Python with numpy and safetensors.

  head_arithmetic.py widen HEAD WHOLE FREQ SIZE OUT [--map]
      HEAD's draft vocabulary grown to SIZE ids: its own ids and LM-head rows kept, the ids FREQ ranks first added
      with the target's rows, read from WHOLE (a head over the whole vocabulary as train-eagle starts one: its LM head
      is the target's). --map first maps the target's rows by the least-squares 576 x 576 matrix that takes the
      target's rows of HEAD's ids to HEAD's trained rows.
  head_arithmetic.py mix OUT WEIGHT=HEAD [WEIGHT=HEAD ...]
      The weighted sum of heads over one draft vocabulary (weights summing to 1 average; 1.25 and -0.25 step past the
      first head along the line from the second).

Heads are folders with config.json and model.safetensors as train-eagle writes them; a packed head (model.gguf, as
heads/ ship) is unpacked first by `frspec train-eagle --arch eagle3 --init-from HEAD --steps 0 ...`.
"""
import json
import pathlib
import sys

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

VOCAB_MAPS = ("d2t", "t2d")


def load(folder):
    folder = pathlib.Path(folder)
    try:
        return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, SafetensorError) as e:
        sys.exit(f"{folder}: not a head folder as train-eagle writes them ({e})")


def target_ids(tensors):
    """The target id of each draft id: draft id d is target id d + d2t[d]."""
    return np.arange(len(tensors["d2t"])) + tensors["d2t"]


def save(folder, tensors, config, ids):
    vocab = len(tensors["t2d"])
    tensors["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    t2d = np.zeros(vocab, dtype=np.uint8)
    t2d[ids] = 1
    tensors["t2d"] = t2d
    config["draft_vocab_size"] = len(ids)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{folder}: {len(ids)} draft ids")


def widen(head, whole, freq, size, out, mapped):
    trained, config = load(head)
    if not len(trained["d2t"]) <= size <= len(trained["t2d"]):
        sys.exit(f"widen: SIZE {size} must lie between the head's {len(trained['d2t'])} draft ids and the vocabulary's {len(trained['t2d'])}")
    target_rows = load(whole)[0]["lm_head.weight"].astype(np.float64)
    if len(target_rows) != len(trained["t2d"]):
        sys.exit(f"{whole}: its LM head has {len(target_rows)} rows, not the target's {len(trained['t2d'])}")
    old = target_ids(trained)
    rows = trained["lm_head.weight"].astype(np.float64)
    if mapped:
        known = target_rows[old]
        m = np.linalg.solve(known.T @ known + 1e-3 * np.eye(known.shape[1]), known.T @ rows)
        fit = known @ m
        cos = (fit * rows).sum(1) / np.linalg.norm(fit, axis=1) / np.linalg.norm(rows, axis=1)
        print(f"map: median cosine of mapped target rows to trained rows {np.median(cos):.3f}")
        target_rows = target_rows @ m
    try:
        ranked = load_file(freq)
        ranked["ids"], ranked["counts"]
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        sys.exit(f"{freq}: not a frequency file as `frspec freq build` writes them ({e})")
    counts = np.zeros(len(target_rows))
    counts[ranked["ids"]] = ranked["counts"]
    ids = set(old.tolist())
    for i in np.argsort(-counts, kind="stable"):
        if len(ids) >= size:
            break
        ids.add(int(i))
    ids = np.array(sorted(ids))
    lm_head = target_rows[ids]
    lm_head[np.searchsorted(ids, old)] = rows
    tensors = dict(trained)
    tensors["lm_head.weight"] = lm_head.astype(trained["lm_head.weight"].dtype)
    save(out, tensors, config, ids)


def weighted(part):
    weight, sep, head = part.partition("=")
    try:
        weight = float(weight)
    except ValueError:
        sep = ""
    if not sep:
        sys.exit(f"mix: {part!r} is not WEIGHT=HEAD")
    return weight, load(head)


def mix(out, parts):
    heads = [weighted(p) for p in parts]
    first, config = heads[0][1]
    for _, (tensors, _) in heads:
        if not np.array_equal(tensors["d2t"], first["d2t"]):
            sys.exit("mix: the heads draft over different vocabularies")
    tensors = {k: v if k in VOCAB_MAPS else sum(w * h[0][k].astype(np.float64) for w, h in heads).astype(v.dtype) for k, v in first.items()}
    save(out, tensors, config, target_ids(first))


def main(args):
    match args:
        case ["widen", head, whole, freq, size, out, *rest] if rest in ([], ["--map"]) and size.isdigit():
            widen(head, whole, freq, int(size), out, rest == ["--map"])
        case ["mix", out, *parts] if parts:
            mix(out, parts)
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
