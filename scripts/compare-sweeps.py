#!/usr/bin/env python3
"""Compare the records of two sweep folders of the same plan, unit by unit, from their journals (units/*.json),
timings left out. Python's standard library only, so it runs on a GPU machine as it is.

  scripts/compare-sweeps.py A B

Prints, per temperature: how many records are identical, how many have identical tokens counts (generated, drafts,
draft tokens, accepted, per position, stop) with only the Rao-Blackwellised expected accepted count differing, and
that float's largest relative difference. Exit 1 if any greedy (T = 0) record differs at all, 2 if the folders do
not compare.
"""
import json
import pathlib
import sys

TIMINGS = ("draft_secs", "target_secs")
FLOAT = "expected_accepted"


def records(folder):
    units = pathlib.Path(folder) / "units"
    if not units.is_dir():
        print(f"compare-sweeps: {folder} holds no sweep (no units/ folder)", file=sys.stderr)
        sys.exit(2)
    out = {}
    for path in sorted(units.glob("t*-p*-r*.json")):
        unit = json.loads(path.read_text())
        for run in unit["runs"]:
            record = {k: v for k, v in run["record"].items() if k not in TIMINGS}
            out[(path.name, run["ratio"], run["temperature"], run["repeat"], run["turn"])] = record
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = records(sys.argv[1]), records(sys.argv[2])
    if a.keys() != b.keys():
        print(f"compare-sweeps: the folders hold different units ({len(a)} and {len(b)} records)", file=sys.stderr)
        sys.exit(2)
    cells = {}
    for key in sorted(a):
        x, y = a[key], b[key]
        c = cells.setdefault(key[2], {"total": 0, "same": 0, "counts": 0, "worst": 0.0})
        c["total"] += 1
        c["same"] += x == y
        if {k: v for k, v in x.items() if k != FLOAT} == {k: v for k, v in y.items() if k != FLOAT}:
            c["counts"] += 1
            c["worst"] = max(c["worst"], abs(x[FLOAT] - y[FLOAT]) / max(abs(x[FLOAT]), 1e-12))
    for t, c in sorted(cells.items()):
        print(f"T = {t}: {c['same']} of {c['total']} records identical; counts identical in {c['counts']}, "
              f"where the expected accepted count differs by at most {c['worst']:.1e} (relative)")
    greedy = cells.get(0.0)
    sys.exit(0 if greedy is None or greedy["same"] == greedy["total"] else 1)


if __name__ == "__main__":
    main()
