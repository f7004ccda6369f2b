"""Prints the numbers quoted in docs/results/claims.md from the recorded raw files.

    python scripts/claims_numbers.py

Robustness (the first record and the equal-lr ones): per run, the accuracy averaged over a
perturbation's levels; then mean, sample standard deviation over seeds, and the EFLA - DeltaNet gap
in units of its standard error. LR sweep: per lr and rule, mean ± sample std over seeds. LM: the bits per
byte of each seed's model on WikiText-2 test and its final validation loss, CPU and H200 runs.
MAD memorization at the protocol's settings: per vocabulary size the best (lr, wd) cell of each rule
where its grid is complete, and every cell with the device that ran it.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections import defaultdict

from efla_lab.harness import read_records
from efla_lab.seeds import gap_in_standard_errors, sample_std

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results"


def robustness() -> None:
    records = [
        ("", RESULTS / "robustness" / "results.json"),
        *((f"{path.parent.name:14s} ", path) for path in sorted((RESULTS / "robustness_equal_lr").glob("*/results.json"))),
    ]
    for name, path in records:
        _robustness_gaps(name, json.loads(path.read_text()))


def _robustness_gaps(name: str, record: dict) -> None:
    per_seed = defaultdict(list)
    for run in record["runs"]:
        for perturbation in ("scale", "noise", "dropout"):
            per_seed[run["setting"], perturbation, run["rule"]].append(statistics.mean(run["eval"][perturbation]["accuracy"]))
    for (setting, perturbation, rule), values in sorted(per_seed.items()):
        if rule != "exact":
            continue
        euler = per_seed[setting, perturbation, "euler"]
        gap, in_errors = gap_in_standard_errors(values, euler)
        print(
            f"robustness {name}{setting:9s} {perturbation:8s} EFLA {statistics.mean(values):.3f} ± "
            f"{statistics.stdev(values):.3f}  DeltaNet {statistics.mean(euler):.3f} ± {statistics.stdev(euler):.3f}"
            f"  gap {gap:+.3f} = {in_errors:.1f} standard errors (n = {len(values)}, {len(euler)})"
        )


def lr_sweep() -> None:
    """Per lr, mean ± sample std over seeds of the final training loss and test accuracy, and the
    seeds whose accuracy fell below 0.5 (a run that failed to train)."""
    record = json.loads((RESULTS / "lr_sweep_3seeds" / "lr_sweep.json").read_text())
    cells = defaultdict(list)
    for row in record["rows"]:
        cells[row["lr"], row["rule"]].append(row)
    for (lr, rule), rows in sorted(cells.items()):
        losses = [r["final_train_loss"] for r in rows]
        accs = [r["test_accuracy"] for r in rows]
        failed = [r["seed"] for r in rows if r["test_accuracy"] < 0.5]
        print(
            f"lr-sweep lr {lr:<6g} {rule:5s} loss {statistics.mean(losses):.3f} ± {sample_std(losses):.3f}"
            f"  accuracy {statistics.mean(accs):.4f} ± {sample_std(accs):.4f}  min {min(accs):.4f}"
            f"  seeds below 0.5: {failed or 'none'} (n = {len(rows)})"
        )


def language_model() -> None:
    cpu = [json.loads(p.read_text()) for p in sorted((RESULTS / "lm" / "eval" / "models").glob("*/eval.json"))]
    _lm_table("lm (CPU, 0.66M)", cpu)
    _lm_table("lm (H200, 100M)", [run["eval"] for run in read_records(str(RESULTS / "lm_gpu_100m" / "runs.jsonl"))])


def _lm_table(title: str, evaluations: list[dict]) -> None:
    """Per variant, mean ± sample std over seeds of WikiText-2 bits per byte and the final
    validation loss (``efla eval``'s records); each exact rule against its Euler counterpart in
    standard errors."""
    by_variant = defaultdict(list)
    for record in evaluations:
        by_variant[_find(record, "variant")].append(record)
    for variant, records in sorted(by_variant.items()):
        line = f"{title} {variant:15s}"
        for key in ("bits_per_byte", "val_loss"):
            values = [_find(r, key) for r in records]
            if None in values:
                continue
            line += f" {key} {statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
            euler = [_find(r, key) for r in by_variant.get(variant.replace("efla", "deltanet"), [])]
            if "efla" in variant and euler and None not in euler:
                gap, in_errors = gap_in_standard_errors(values, euler)
                line += f" (vs Euler {gap:+.4f} = {in_errors:.1f} standard errors)"
        print(f"{line} (n = {len(records)})")


def mad_memorization() -> None:
    runs = read_records(str(RESULTS / "mad" / "memorization-protocol" / "runs.jsonl"))
    by_setting = defaultdict(dict)
    best_per_setting = defaultdict(list)
    for run in runs:
        by_setting[run["setting"]][run["rule"], run["lr"], run["weight_decay"]] = run
    for setting, cells in sorted(by_setting.items(), key=lambda kv: int(kv[0].split("-v")[1].split("-")[0])):
        for (rule, lr, wd), run in sorted(cells.items()):
            print(
                f"mad {setting} {rule:5s} lr {lr:<6g} wd {wd:<3g} accuracy {100 * run['test_acc']:5.1f} "
                f"(best epoch {run['best_epoch']}, {run['device']})"
            )
        for rule in ("exact", "euler"):
            own = [run for (r, _, _), run in cells.items() if r == rule]
            best = max(own, key=lambda run: run["test_acc"]) if len(own) == 6 else None
            if best:
                best_per_setting[rule].append(best["test_acc"])
            print(
                f"mad {setting} {rule:5s} best cell: "
                + (
                    f"{100 * best['test_acc']:.1f} (lr {best['lr']:g}, wd {best['weight_decay']:g})"
                    if best
                    else f"grid not complete ({len(own)} of 6)"
                )
            )
    for rule, bests in best_per_setting.items():
        score = f"{100 * statistics.mean(bests):.1f}" if len(bests) == len(by_setting) else "not complete"
        print(f"mad memorization {rule:5s} task score (mean of the per-setting best cells): {score}")


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
    lr_sweep()
    language_model()
    mad_memorization()
