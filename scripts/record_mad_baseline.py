"""Regenerate docs/results/mad/baseline-grid from its recorded runs, any newer runs stored in
.devmad/baseline/runs (git-ignored, where CPU and device runs land) and the memorization protocol's
V = 256 runs: runs.jsonl (its runs, one line each), runs.csv, mad_scores.png and results.json (its
runs as references ``FILE#KEY`` relative to the record). summary.md is written by hand.
Usage: python scripts/record_mad_baseline.py [--command-as-run TEXT]"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

from efla_lab import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, "docs", "results", "mad", "baseline-grid")
MEMORIZATION = os.path.join(REPO, "docs", "results", "mad", "memorization-protocol", "runs.jsonl")
NEW_RUNS = os.path.join(REPO, ".devmad", "baseline", "runs")
REPORT_COMMAND = (
    "python -m efla mad --preset baseline --report-only --out DIR (DIR/runs.jsonl: runs.jsonl here and "
    "the V = 256 lines of ../memorization-protocol/runs.jsonl)"
)


def gather_runs(into: str) -> None:
    """Every run of the record as ``into/<key>.json`` (a run stored since the record replaces its line)."""
    os.makedirs(into)
    recorded = harness.read_records(os.path.join(RECORD, "runs.jsonl"))
    protocol = [r for r in harness.read_records(MEMORIZATION) if r["key"].startswith("M-v256-")]
    for run in recorded + protocol:
        harness.atomic_write_json(os.path.join(into, run["key"] + ".json"), run)
    for path in glob.glob(os.path.join(NEW_RUNS, "*.json")):
        shutil.copy(path, into)


def reference(key: str) -> str:
    if key.startswith("M-"):
        return f"../memorization-protocol/runs.jsonl#{key}"
    return f"runs.jsonl#{key}"


def write_record(report_dir: str, command_as_run: str | None) -> dict:
    with open(os.path.join(RECORD, "results.json")) as f:
        previous = json.load(f)
    with open(os.path.join(report_dir, "results.json")) as f:
        results = json.load(f)
    own = [r for r in results["runs"] if not r["key"].startswith("M-")]
    harness.write_records(os.path.join(RECORD, "runs.jsonl"), sorted(own, key=lambda r: r["key"]))
    for name in ("runs.csv", "mad_scores.png"):
        shutil.copy(os.path.join(report_dir, name), RECORD)
    stored, missing = len(results["runs"]), len(results["missing"])
    results["runs"] = [reference(r["key"]) for r in results["runs"]]
    results["command"] = REPORT_COMMAND
    results["command_as_run"] = command_as_run or previous["command_as_run"]
    if missing:
        results["partial_note"] = (
            f'PARTIAL: {stored} of {stored + missing} planned runs; "missing" lists the others. "scores" take the '
            "best of the stored cells of each setting, so a task with missing cells is scored on part of its grid, "
            "and they average the tasks with stored runs only: not MAD's six-task average."
        )
    tmp = os.path.join(RECORD, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(RECORD, "results.json"))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command-as-run", default=None, help="replaces results.json's command_as_run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gather_runs(os.path.join(tmp, "runs"))
        subprocess.run(
            [sys.executable, "-m", "efla", "mad", "--preset", "baseline", "--report-only", "--out", tmp], check=True, cwd=REPO
        )
        results = write_record(tmp, args.command_as_run)
    print(f"{len(results['runs'])} runs recorded, {len(results['missing'])} missing; scores: {results['scores']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
