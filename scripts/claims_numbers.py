"""Prints the numbers quoted in docs/results/claims.md from the recorded raw files.

    python scripts/claims_numbers.py

Robustness: per run, the accuracy averaged over a perturbation's levels; then mean, sample standard
deviation over seeds, and the EFLA - DeltaNet gap in units of its standard error. LM: the bits per
byte of each seed's model on WikiText-2 test.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from collections import defaultdict

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results"


def robustness() -> None:
    record = json.loads((RESULTS / "robustness" / "results.json").read_text())
    per_seed = defaultdict(list)
    for run in record["runs"]:
        for perturbation in ("scale", "noise", "dropout"):
            per_seed[run["setting"], perturbation, run["rule"]].append(
                statistics.mean(run["eval"][perturbation]["accuracy"]))
    for (setting, perturbation, rule), values in sorted(per_seed.items()):
        if rule != "exact":
            continue
        euler = per_seed[setting, perturbation, "euler"]
        gap = statistics.mean(values) - statistics.mean(euler)
        se = math.sqrt(statistics.variance(values) / len(values) + statistics.variance(euler) / len(euler))
        print(f"robustness {setting:9s} {perturbation:8s} EFLA {statistics.mean(values):.3f} ± "
              f"{statistics.stdev(values):.3f}  DeltaNet {statistics.mean(euler):.3f} ± {statistics.stdev(euler):.3f}"
              f"  gap {gap:+.3f} = {gap / se:.1f} standard errors (n = {len(values)}, {len(euler)})")


def language_model() -> None:
    by_variant = defaultdict(list)
    for path in sorted((RESULTS / "lm" / "eval" / "models").glob("*/eval.json")):
        record = json.loads(path.read_text())
        by_variant[path.parent.name.rsplit("-s", 1)[0]].append(record)
    for variant, records in sorted(by_variant.items()):
        bpb = [_find(r, "bits_per_byte") for r in records]
        print(f"lm {variant:15s} WikiText-2 bits/byte {statistics.mean(bpb):.4f} ± {statistics.stdev(bpb):.4f} "
              f"(n = {len(bpb)})")


def _find(record, key):
    """The first value stored under ``key`` anywhere in a nested record."""
    if isinstance(record, dict):
        if key in record:
            return record[key]
        for value in record.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    robustness()
    language_model()
