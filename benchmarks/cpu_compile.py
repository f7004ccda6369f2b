"""Training speed of the tiny presets on the CPU with and without ``torch.compile`` (inductor).

Each preset is built twice from one initialisation; the eager and the compiled model take
training steps (forward, loss, backward, AdamW) in turn on the same random tokens, so both see the
same machine state. The compiled model's first steps (compilation) are timed apart; every
measured round's rate goes into the record (``--out``, benchmarks/evidence.py's shape). Also reported: the number of graphs
Dynamo built and whether anything recompiled after the first step.

    python benchmarks/cpu_compile.py --presets tiny-efla,tiny-gated-efla --threads 2 [--rounds 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from functools import partial

import evidence
import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from alternate import alternate, default_out, load_average, spread

from efla.models import EFLAForCausalLM, get_preset_config

COMPILED, EAGER = "torch.compile (inductor)", "eager"


def step_seconds(forward, opt, ids) -> float:
    start = time.perf_counter()
    forward(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench(preset: str, batch: int, seq: int, warmup: int, rounds: int) -> tuple[dict, dict]:
    """The measurement (training tokens/s of every round, compiled vs eager) and what Dynamo did."""
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = EFLAForCausalLM(get_preset_config(preset)).train()
    torch.manual_seed(0)
    twin = EFLAForCausalLM(get_preset_config(preset)).train()
    compiled = torch.compile(twin, dynamic=False)
    steps = {
        COMPILED: partial(step_seconds, compiled, torch.optim.AdamW(twin.parameters()), ids),
        EAGER: partial(step_seconds, eager, torch.optim.AdamW(eager.parameters()), ids),
    }
    compile_steps = [steps[COMPILED]() for _ in range(warmup)]
    for _ in range(warmup):
        steps[EAGER]()
    graphs_before = counters["stats"]["unique_graphs"]
    per_round, _ = alternate(steps, rounds, warmup=0)
    dynamo = dict(
        compile_steps_s=compile_steps,
        graphs=counters["stats"]["unique_graphs"],
        recompiled_after_warmup=counters["stats"]["unique_graphs"] != graphs_before,
        graph_breaks=sum(counters["graph_break"].values()),
    )
    return record(per_round, batch * seq, f"{preset}, batch {batch} x {seq}"), dynamo


def record(per_round: dict, tokens: int, case: str) -> dict:
    """Training tokens/s of every round, the compiled model against the eager one."""
    rate = lambda name: (name, [tokens / t for t in per_round[name]])  # noqa: E731
    return evidence.measurement(case, "training step tokens/s", "tokens/s", "higher", rate(COMPILED), rate(EAGER))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny-efla,tiny-gated-efla")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=default_out("cpu_compile"), help="the JSON record (benchmarks/evidence.py's shape)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    print(f"### CPU, `torch.compile` (inductor) vs eager, training steps ({datetime.date.today()})\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq} tokens, "
        f"{args.rounds} alternated steps after {args.warmup} warm-up steps\n"
    )
    print(
        "| preset | speed-up, median (min-max) | eager tokens/s | compiled tokens/s | first compiled steps (s) | graphs | "
        "graph breaks | recompiled after warm-up |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    measurements, notes = [], []
    for preset in args.presets.split(","):
        m, r = bench(preset, args.batch, args.seq, args.warmup, args.rounds)
        measurements.append(m)
        first = " / ".join(f"{s:.1f}" for s in r["compile_steps_s"])
        eager, compiled = (statistics.median(m[side]["rounds"]) for side in ("baseline", "ours"))
        print(
            f"| `{preset}` | {spread(m)} | {eager:,.0f} | {compiled:,.0f} | {first} | {r['graphs']} | {r['graph_breaks']} | "
            f"{'yes' if r['recompiled_after_warmup'] else 'no'} |",
            flush=True,
        )
        notes.append(
            f"{preset}: warm-up steps of the compiled model {first} s (the first compiles); {r['graphs']} graphs, "
            f"{r['graph_breaks']} graph breaks, recompiled after warm-up: {'yes' if r['recompiled_after_warmup'] else 'no'}"
        )
    notes = [
        f"A training step: forward, loss, backward, AdamW step, float32, {torch.get_num_threads()} torch threads, "
        f"batch {args.batch} x {args.seq} random tokens; compiled = torch.compile(model, dynamic=False), default "
        "inductor backend, built from the same initialisation as the eager model.",
        f"{args.warmup} warm-up steps of the compiled model, then of the eager one, then {args.rounds} rounds "
        "alternating compiled and eager steps in one process; every round kept.",
        *notes,
        f"load average before: {load_before}",
    ]
    title = "CPU training step: torch.compile (inductor) vs eager, the same tiny model, float32"
    evidence.write_run(args.out, "cpu_compile", title, args.rounds, measurements, notes)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
