"""The raw result files every quoted speed number comes from: one JSON file per benchmark run under
``benchmarks/results/<area>/``, in one shape (``SCHEMA``), written by :func:`write_run` and read back
(and checked) by :func:`load_run`. ``benchmarks/report.py`` turns them into the performance page.

A run holds its provenance (date, device, versions, commit, command, rounds) and a list of
measurements. A measurement compares ``ours`` against ``baseline`` on one case, each with the value
of every alternated round (``rounds``), so a ratio is quoted with its spread. ``better`` says which
way is faster: ``"lower"`` for times, ``"higher"`` for throughputs. A measurement with no baseline
(``baseline: null``) is a plain figure (a decode step's time, a peak memory). Runs converted from an
older record that kept only medians have ``rounds_kept: false`` and one value per side."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

SCHEMA = 1
BETTER = ("lower", "higher")
RUN_KEYS = {
    "schema", "benchmark", "title", "date", "device", "versions", "commit", "command", "rounds",
    "rounds_kept", "notes", "measurements",
}  # fmt: skip
MEASUREMENT_KEYS = {"case", "metric", "unit", "better", "ours", "baseline"}
SIDE_KEYS = {"name", "rounds"}


def _carried_commit(root: str) -> str:
    """A device's copy of the checkout has no .git: ``.commit`` (git-ignored, carried) names it."""
    try:
        with open(os.path.join(root, ".commit")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def _git_commit(root: str) -> str:
    """The checkout's commit, ``-dirty`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return _carried_commit(root)
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    """The processor's model name and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"CPU: {name}, {len(os.sched_getaffinity(0))} cores"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()


def library_versions() -> dict:
    """Python and the libraries a benchmark may compare (those installed)."""
    import importlib

    found = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "fla", "efla"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except ImportError:
            continue
    return found


# Variables that change what a benchmark measures, named in its record when set
SETTINGS = ("EFLA_", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "MALLOC_", "TORCH_", "TRITON_", "CUDA_VISIBLE_DEVICES", "PYTHONMALLOC")


def _setting_notes() -> list[str]:
    found = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(SETTINGS))
    return [f"set in the environment: {' '.join(found)}"] if found else []


def measurement(
    case: str, metric: str, unit: str, better: str, ours: tuple[str, list], baseline: tuple[str, list] | None
) -> dict:
    """One compared case: ``ours`` and ``baseline`` are ``(name, values per round)``."""
    side = lambda pair: None if pair is None else {"name": pair[0], "rounds": [float(v) for v in pair[1]]}  # noqa: E731
    return {"case": case, "metric": metric, "unit": unit, "better": better, "ours": side(ours), "baseline": side(baseline)}


def write_run(
    path: str, benchmark: str, title: str, rounds: int, measurements: list[dict], notes: list[str] = (), argv=None
) -> dict:
    """Writes one run (atomically) with its provenance filled in from this process and checkout."""
    from efla.records import atomic_write_json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "title": title,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(),
        "versions": library_versions(),
        "commit": _git_commit(root),
        "command": shlex.join(["python", os.path.relpath(sys.argv[0], root), *(sys.argv[1:] if argv is None else argv)]),
        "rounds": rounds,
        "rounds_kept": True,
        "notes": list(notes) + _setting_notes() + [f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"],
        "measurements": measurements,
    }
    check_run(run, path)
    atomic_write_json(path, run)
    return run


def check_run(run: dict, where: str) -> None:
    """Raises ``ValueError`` naming ``where`` and the field when ``run`` is not in the shape above."""

    def fail(what):
        raise ValueError(f"{where}: {what}")

    if set(run) != RUN_KEYS:
        fail(f"keys {sorted(set(run) ^ RUN_KEYS)} missing or unknown")
    if run["schema"] != SCHEMA:
        fail(f"schema {run['schema']!r}, expected {SCHEMA}")
    for key in ("benchmark", "title", "date", "device", "commit", "command"):
        if not isinstance(run[key], str) or not run[key]:
            fail(f"{key} must be a non-empty string")
    if not run["versions"].get("torch"):
        fail("versions must name torch")
    if not run["measurements"]:
        fail("no measurements")
    for i, m in enumerate(run["measurements"]):
        if set(m) != MEASUREMENT_KEYS:
            fail(f"measurement {i}: keys {sorted(set(m) ^ MEASUREMENT_KEYS)} missing or unknown")
        if m["better"] not in BETTER:
            fail(f"measurement {i}: better must be one of {BETTER}")
        expected = run["rounds"] if run["rounds_kept"] else 1
        for side in ("ours", "baseline"):
            if m[side] is None and side == "baseline":
                continue
            if set(m[side]) != SIDE_KEYS or len(m[side]["rounds"]) != expected:
                fail(f"measurement {i} ({m['case']}): {side} must have a name and {expected} values")


def load_run(path: str) -> dict:
    with open(path) as f:
        run = json.load(f)
    check_run(run, path)
    return run


def ratios(m: dict) -> list[float]:
    """The measurement's speed-up over its baseline, round by round (above 1: ours is faster)."""
    ours, theirs = m["ours"]["rounds"], m["baseline"]["rounds"]
    pairs = zip(ours, theirs, strict=True)
    return [t / o if m["better"] == "lower" else o / t for o, t in pairs]


def summary(values: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest."""
    return statistics.median(values), min(values), max(values)
