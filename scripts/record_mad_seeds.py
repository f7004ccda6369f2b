"""Record MAD's fuzzy recall over seeds at its baseline setting's lr 1e-3 cells (wd 0 and 0.1), where
seed 12345's grid found its best cells: docs/results/mad/fuzzy-recall-seeds/ gets runs.jsonl (the runs
of the other seeds, one line each, from .devmad/fr-seeds*/runs, git-ignored), runs.csv, results.json
(per cell and rule each seed's accuracy, mean and sample std, and the paired EFLA - DeltaNet
difference) and seeds.png. Seed 12345's runs stay in ../baseline-grid/runs.jsonl and are listed by
their reference there.
summary.md is written by hand. Usage: python scripts/record_mad_seeds.py [--command-as-run TEXT]"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os

from efla_lab import harness
from efla_lab.seeds import paired_differences, spread
from efla_lab.mad.report import CSV_FIELDS, csv_row
from efla.variants import label
from efla_lab.style import colour

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, "docs", "results", "mad", "fuzzy-recall-seeds")
BASELINE = os.path.join(REPO, "docs", "results", "mad", "baseline-grid")
NEW_RUNS = os.path.join(REPO, ".devmad", "fr-seeds*", "runs")
RUN_PATTERN = "FR-v16-l128-n12800-m33__*__lr0.001-*-e200-*-s{seed}-fp32.json"
SEEDS = (12345, 1, 2)
RULES = ("exact", "euler")
WEIGHT_DECAYS = (0.0, 0.1)


def _wanted(run: dict, seed: int) -> bool:
    return fnmatch.fnmatch(run["key"] + ".json", RUN_PATTERN.format(seed=seed))


def copy_new_runs() -> None:
    """The other seeds' finished runs from the git-ignored stores into the record's runs.jsonl (a key
    in several stores: the one trained last)."""
    path = os.path.join(RECORD, "runs.jsonl")
    runs = {r["key"]: r for r in harness.read_records(path)} if os.path.exists(path) else {}
    for seed in SEEDS[1:]:
        for stored in sorted(glob.glob(os.path.join(NEW_RUNS, RUN_PATTERN.format(seed=seed))), key=os.path.getmtime):
            with open(stored) as f:
                run = json.load(f)
            runs[run["key"]] = run
    harness.write_records(path, [runs[key] for key in sorted(runs)])


def gather() -> list[tuple[str, dict]]:
    """(reference relative to the record, run) for every seed's lr 1e-3 runs: each rule and weight
    decay, trained to its epoch budget."""
    found = []
    for seed in SEEDS:
        in_grid = seed == 12345
        where = BASELINE if in_grid else RECORD
        rel = "../baseline-grid/runs.jsonl" if in_grid else "runs.jsonl"
        runs = sorted(
            (r for r in harness.read_records(os.path.join(where, "runs.jsonl")) if _wanted(r, seed)), key=lambda r: r["key"]
        )
        for run in runs:
            stopped_short = run["epochs_run"] < run["config"]["epochs"] and not run["stopped_early"]
            if run["truncated"] or run["diverged"] or stopped_short:
                raise SystemExit(f"record_mad_seeds: not a finished run ({rel}#{run['key']})")
            found.append((f"{rel}#{run['key']}", run))
    have = {(r["config"]["seed"], r["rule"], r["weight_decay"]) for _, r in found}
    wanted = {(s, rule, wd) for s in SEEDS for rule in RULES for wd in WEIGHT_DECAYS}
    if have != wanted:
        raise SystemExit(f"record_mad_seeds: runs missing (seed, rule, wd): {sorted(wanted - have)}")
    return found


def compared(by_rule: dict) -> dict:
    """Each rule's accuracies by seed with their spread, and the paired difference EFLA - DeltaNet."""
    out = {rule: {"by_seed": accs, **spread(list(accs.values()))} for rule, accs in by_rule.items()}
    paired = paired_differences(by_rule["exact"], by_rule["euler"])
    out["difference"] = {"by_seed": paired, **spread(list(paired.values()))}
    return out


def cells(runs: list[dict]) -> dict:
    """Per weight decay, each rule's accuracy (at the lowest-test-perplexity epoch) by seed, compared."""
    by = {(r["weight_decay"], r["rule"], r["config"]["seed"]): r["test_acc"] for r in runs}
    return {
        f"lr0.001-wd{wd:g}": compared({rule: {s: by[(wd, rule, s)] for s in SEEDS} for rule in RULES}) for wd in WEIGHT_DECAYS
    }


def best_cell_per_seed(cell_table: dict) -> dict:
    """Each seed's best of the lr 1e-3 cells, per rule (the task's score restricted to these cells)."""
    return compared({rule: {s: max(c[rule]["by_seed"][s] for c in cell_table.values()) for s in SEEDS} for rule in RULES})


def plot(cell_table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cell_table), figsize=(4.2 * len(cell_table), 3.6), sharey=True)
    for ax, (name, cell) in zip(axes, cell_table.items()):
        for i, rule in enumerate(RULES):
            xs = [j + (i - 0.5) * 0.38 for j in range(len(SEEDS))]
            vals = [100 * cell[rule]["by_seed"][s] for s in SEEDS]
            ax.bar(xs, vals, 0.38, color=colour(rule), label=label(rule), edgecolor="black", linewidth=0.4)
            for x, v in zip(xs, vals):
                ax.text(x, v + 0.8, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(SEEDS)))
        ax.set_xticklabels([f"seed {s}" for s in SEEDS])
        ax.set_title(f"fuzzy recall, {name.replace('lr0.001-', 'lr 1e-3, ').replace('wd', 'wd ')}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    top = max(100 * v for cell in cell_table.values() for rule in RULES for v in cell[rule]["by_seed"].values())
    axes[0].set_ylim(0, 1.15 * top)
    axes[0].set_ylabel("test accuracy (%) at the lowest test perplexity")
    axes[0].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    harness.atomic_save_figure(fig, path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command-as-run", default=None, help="replaces results.json's command_as_run")
    args = parser.parse_args()
    copy_new_runs()
    found = gather()
    runs = [r for _, r in found]
    table = cells(runs)
    previous = os.path.join(RECORD, "results.json")
    command_as_run = args.command_as_run
    if command_as_run is None and os.path.exists(previous):
        with open(previous) as f:
            command_as_run = json.load(f)["command_as_run"]
    results = {
        "command": "python scripts/record_mad_seeds.py",
        "command_as_run": command_as_run,
        "device": sorted({r["device"] for r in runs}),
        "runs": [rel for rel, _ in found],
        "cells": table,
        "best_cell_per_seed": best_cell_per_seed(table),
    }
    harness.atomic_write(previous, json.dumps(results, indent=1))
    harness.atomic_write_csv(os.path.join(RECORD, "runs.csv"), CSV_FIELDS, (csv_row(r) for r in runs))
    plot(table, os.path.join(RECORD, "seeds.png"))
    for name, cell in {**table, "best cell per seed": results["best_cell_per_seed"]}.items():
        print(name, "  ".join(f"{k}: {100 * cell[k]['mean']:.2f} ± {100 * cell[k]['std']:.2f}" for k in (*RULES, "difference")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
