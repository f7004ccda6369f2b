"""Training speed of the tiny presets on the CPU with and without ``torch.compile`` (inductor).

Each preset is built twice from one initialisation; the eager and the compiled model take
training steps (forward, loss, backward, AdamW) in turn on the same random tokens, so both see the
same machine state. The compiled model's first steps (compilation) are timed apart; the
steady-state rate is the median over the measured rounds. Also reported: the number of graphs
Dynamo built and whether anything recompiled after the first step.

    python benchmarks/cpu_compile.py --presets tiny-efla,tiny-gated-efla --threads 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from efla.models import EFLAForCausalLM, get_preset_config


def step_seconds(forward, opt, ids) -> float:
    start = time.perf_counter()
    forward(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench(preset: str, batch: int, seq: int, warmup: int, rounds: int) -> dict:
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = EFLAForCausalLM(get_preset_config(preset)).train()
    torch.manual_seed(0)
    twin = EFLAForCausalLM(get_preset_config(preset)).train()
    compiled = torch.compile(twin, dynamic=False)
    opts = {"eager": torch.optim.AdamW(eager.parameters()), "compiled": torch.optim.AdamW(twin.parameters())}
    runs = {"eager": eager, "compiled": compiled}
    first = [step_seconds(compiled, opts["compiled"], ids) for _ in range(warmup)]
    for _ in range(warmup):
        step_seconds(eager, opts["eager"], ids)
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, forward in runs.items():
            times[name].append(step_seconds(forward, opts[name], ids))
    rates = {name: batch * seq / statistics.median(t) for name, t in times.items()}
    return dict(
        preset=preset,
        batch=batch,
        seq=seq,
        tokens_per_s=rates,
        speedup=rates["compiled"] / rates["eager"],
        compile_steps_s=first,
        graphs=counters["stats"]["unique_graphs"],
        recompiled_after_warmup=counters["stats"]["unique_graphs"] != graphs_after_warmup,
        graph_breaks=sum(counters["graph_break"].values()),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny-efla,tiny-gated-efla")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"### CPU, `torch.compile` (inductor) vs eager, training steps ({datetime.date.today()})\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq} tokens, "
        f"median of {args.rounds} alternated steps after {args.warmup} warm-up steps\n"
    )
    print(
        "| preset | eager tokens/s | compiled tokens/s | speed-up | first compiled steps (s) | graphs | "
        "graph breaks | recompiled after warm-up |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset in args.presets.split(","):
        r = bench(preset, args.batch, args.seq, args.warmup, args.rounds)
        first = " / ".join(f"{s:.1f}" for s in r["compile_steps_s"])
        print(
            f"| `{preset}` | {r['tokens_per_s']['eager']:,.0f} | {r['tokens_per_s']['compiled']:,.0f} | "
            f"{r['speedup']:.2f}x | {first} | {r['graphs']} | {r['graph_breaks']} | "
            f"{'yes' if r['recompiled_after_warmup'] else 'no'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
