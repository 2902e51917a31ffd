#!/usr/bin/env python3
"""Compare the records of two sweep folders of the same plan, unit by unit, from their journals (units/*.json),
timings left out. Python's standard library only, so it runs on a GPU machine as it is.

  scripts/compare-sweeps.py A B        prints, per temperature index, how many records are identical;
                                       exit 1 if any greedy (T = 0) record differs, 2 if the folders do not compare.
"""
import json
import pathlib
import sys

TIMINGS = ("draft_secs", "target_secs")


def records(folder):
    units = pathlib.Path(folder) / "units"
    if not units.is_dir():
        sys.exit(f"compare-sweeps: {folder} holds no sweep (no units/ folder)")
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
    by_temperature = {}
    for key in sorted(a):
        same, total = by_temperature.get(key[2], (0, 0))
        by_temperature[key[2]] = (same + (a[key] == b[key]), total + 1)
    for t, (same, total) in sorted(by_temperature.items()):
        print(f"T = {t}: {same} of {total} records identical")
    greedy = by_temperature.get(0.0, (0, 0))
    sys.exit(0 if greedy[0] == greedy[1] else 1)


if __name__ == "__main__":
    main()
