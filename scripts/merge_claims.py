"""Merges robustness or lr-sweep records that ran as separate processes (one per seed, or per
seed, rule and lr, so that a device call cut short keeps what finished) into one record, written
the way `efla robustness` / `efla lr-sweep` write theirs.

    python scripts/merge_claims.py robustness OUT RUN_DIR... --command "what ran"
    python scripts/merge_claims.py lr-sweep OUT RUN_DIR... --command "what ran"

Every part must have the same options apart from its seeds and rules (same data, lr, epochs,
model); the merged record lists the union of the parts' seeds, rules and (sweep) lrs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from efla_lab.robustness.report import write_lr_sweep_outputs, write_robustness_outputs

RECORD = {"robustness": ("results.json", "runs"), "lr-sweep": ("lr_sweep.json", "rows")}
PER_PART = {"seeds", "rules", "command", "aggregate"}  # what may differ between parts


def merge(kind: str, parts: list[dict]) -> dict:
    """One record from ``parts``: their runs (or sweep rows) together, options checked equal."""
    _, items = RECORD[kind]
    first = parts[0]
    for part in parts[1:]:
        for key in set(first["options"]) | set(part["options"]):
            if key not in PER_PART and first["options"].get(key) != part["options"].get(key):
                raise SystemExit(
                    f"merge_claims: parts differ in option {key!r}: {first['options'].get(key)!r} vs {part['options'].get(key)!r}"
                )
        if part.get("dataset") != first.get("dataset"):
            raise SystemExit("merge_claims: parts ran on different data")
    merged = {k: v for k, v in first.items() if k not in ("aggregate", "command", "wall_seconds")}
    walls = [part["wall_seconds"] for part in parts if "wall_seconds" in part]
    if walls:  # each part's own time, and the longest (the parts ran side by side, in waves)
        merged.update(wall_seconds=max(walls), part_wall_seconds=walls)
    merged[items] = [item for part in parts for item in part[items]]
    keys = [(i.get("setting"), i["rule"], i["seed"], i.get("lr")) for i in merged[items]]
    if len(set(keys)) != len(keys):
        raise SystemExit("merge_claims: the same (setting, rule, seed, lr) appears in two parts")
    merged["options"] = dict(
        first["options"],
        seeds=sorted({s for p in parts for s in p["options"]["seeds"]}),
        rules=list(dict.fromkeys(r for p in parts for r in p["options"]["rules"])),
    )
    if "lrs" in first:
        merged["lrs"] = sorted({lr for part in parts for lr in part["lrs"]})
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(RECORD))
    parser.add_argument("out")
    parser.add_argument("parts", nargs="+", type=pathlib.Path)
    parser.add_argument("--command", required=True, help="the commands that produced the parts")
    args = parser.parse_args(argv)
    name, _ = RECORD[args.kind]
    missing = [str(p) for p in args.parts if not (p / name).is_file()]
    if missing:
        print(f"merge_claims: no {name} in {', '.join(missing)} (skipped: a part that did not finish)", file=sys.stderr)
    parts = [json.loads((p / name).read_text()) for p in args.parts if (p / name).is_file()]
    if not parts:
        raise SystemExit("merge_claims: no finished part to merge")
    write = write_robustness_outputs if args.kind == "robustness" else write_lr_sweep_outputs
    print("Wrote: " + ", ".join(write(merge(args.kind, parts), args.out, args.command)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
