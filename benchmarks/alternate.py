"""Alternated rounds for the CPU benchmarks: every method warms up, then the methods take turns
round by round in one process, so a change in the machine's load falls on all of them alike and
each method keeps one value per round (what :func:`evidence.measurement` records)."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import evidence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alternate(methods: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> tuple[dict, dict]:
    """Calls each method ``warmup`` times (in turn, method by method), then every method once per
    round for ``rounds`` rounds. Returns ``(per_round, warm)``: each method's results in order."""
    warm = {name: [fn() for _ in range(warmup)] for name, fn in methods.items()}
    per_round = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            per_round[name].append(fn())
    return per_round, warm


def seconds(fn: Callable, *args, clock: Callable[[], float] = time.perf_counter) -> float:
    """Wall-clock seconds of one call ``fn(*args)``."""
    start = clock()
    fn(*args)
    return clock() - start


def default_out(benchmark: str) -> str:
    """``benchmarks/results/cpu/<UTC date>_<benchmark>.json`` in this checkout."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return os.path.join(ROOT, "benchmarks", "results", "cpu", f"{date}_{benchmark}.json")


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, for a record's notes."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def spread(m: dict) -> str:
    """A measurement's per-round speed-up over its baseline as ``median (min-max)``, for the console."""
    median, low, high = evidence.summary(evidence.ratios(m))
    return f"{median:.2f}x ({low:.2f}-{high:.2f}x)"
