"""The fuzzy-recall seeds record agrees with the run files it lists: each seed's accuracy is its run's,
the spreads are the sample statistics of those accuracies, and the differences pair seeds."""

from __future__ import annotations

import csv
import json
import pathlib
import statistics

import pytest

from efla.records import recorded

RECORD = pathlib.Path(__file__).resolve().parents[2] / "docs/results/mad/fuzzy-recall-seeds"


def _record():
    results = json.loads((RECORD / "results.json").read_text())
    runs = [recorded(str(RECORD), ref) for ref in results["runs"]]
    return results, runs


def test_each_seed_accuracy_is_its_runs():
    results, runs = _record()
    for run in runs:
        cell = results["cells"][f"lr0.001-wd{run['weight_decay']:g}"]
        assert cell[run["rule"]]["by_seed"][str(run["config"]["seed"])] == pytest.approx(run["test_acc"], abs=1e-12)
    listed = sum(len(cell[rule]["by_seed"]) for cell in results["cells"].values() for rule in ("exact", "euler"))
    assert listed == len(runs) == 12  # 3 seeds x 2 rules x 2 weight decays
    assert {(r["config"]["seed"], r["rule"], r["weight_decay"]) for r in runs} == {
        (s, rule, wd) for s in (12345, 1, 2) for rule in ("exact", "euler") for wd in (0.0, 0.1)
    }


def test_spreads_and_paired_differences_follow_from_the_seeds():
    results, _ = _record()
    for cell in [*results["cells"].values(), results["best_cell_per_seed"]]:
        by = {rule: cell[rule]["by_seed"] for rule in ("exact", "euler")}
        for seed, diff in cell["difference"]["by_seed"].items():
            assert diff == pytest.approx(by["exact"][seed] - by["euler"][seed], abs=1e-12)
        for entry in (cell["exact"], cell["euler"], cell["difference"]):
            values = list(entry["by_seed"].values())
            assert entry["mean"] == pytest.approx(statistics.mean(values), abs=1e-12)
            assert entry["std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
            assert entry["standard_error"] == pytest.approx(statistics.stdev(values) / len(values) ** 0.5, abs=1e-12)


def test_best_cell_per_seed_is_the_better_of_the_cells():
    results, _ = _record()
    best = results["best_cell_per_seed"]
    for rule in ("exact", "euler"):
        for seed, acc in best[rule]["by_seed"].items():
            assert acc == max(cell[rule]["by_seed"][seed] for cell in results["cells"].values())


def test_csv_has_a_row_per_listed_run():
    results, runs = _record()
    with open(RECORD / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["key"] for r in rows) == sorted(run["key"] for run in runs)
    assert {r["seed"] for r in rows} == {"12345", "1", "2"}
