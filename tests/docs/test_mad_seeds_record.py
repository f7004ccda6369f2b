"""The fuzzy-recall seeds record agrees with the run files it lists: each seed's accuracy is its run's,
the spreads are the sample statistics of those accuracies, and the differences pair seeds."""

from __future__ import annotations

import csv
import json
import pathlib
import statistics

import pytest

RECORD = pathlib.Path(__file__).resolve().parents[2] / "docs/results/mad/fuzzy-recall-seeds"


def _record():
    if not (RECORD / "results.json").exists():
        pytest.skip("no fuzzy-recall seeds record in this checkout")
    results = json.loads((RECORD / "results.json").read_text())
    runs = [json.loads((RECORD / rel).read_text()) for rel in results["runs"]]
    return results, runs


def test_each_seed_accuracy_is_its_runs():
    results, runs = _record()
    for run in runs:
        cell = results["cells"][f"lr0.001-wd{run['weight_decay']:g}"]
        assert cell[run["rule"]]["by_seed"][str(run["config"]["seed"])] == pytest.approx(run["test_acc"], abs=1e-12)
    listed = sum(len(cell[rule]["by_seed"]) for cell in results["cells"].values() for rule in ("exact", "euler"))
    assert listed == len(runs)


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


def test_csv_has_a_row_per_listed_run():
    results, runs = _record()
    with open(RECORD / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["key"] for r in rows) == sorted(run["key"] for run in runs)
    assert {r["seed"] for r in rows} == {"12345", "1", "2"}
