"""CPU speculative decoding: ``generate(..., speculate={"method": "ngram"})`` (prompt lookup) against
plain ``generate`` on the same model, float32, batch 1 and 8, alternated rounds in one process.

The kinds of text (``copying``, ``code editing``: lookup helps; ``free``: it does not) and the
measurement are ``benchmarks/speculation.py``'s, shared with ``gpu_generate.py``'s speculative
stage. Per kind and batch: new tokens/s of both (each round times one speculative call, one with
every draft verified (``verify_cost=1``, no turn-down: the control), then one plain call, for
``--rounds`` rounds) with the ratios' spread, the acceptance rate (kept / drafted
tokens verified), new tokens per row per verification pass, the share of target passes that
verified (the rest were the engine's plain steps: speculation turning itself down) and new tokens
per row per target pass.

Then two diagnostics: a verification pass of ``k + 1`` positions against one plain decoding step at
batch 1 and 8 (the ratio the turn-down rule's ``verify_cost`` stands for), and the batch-1 plain step
against its floor: the bytes a step must move (every weight read once, the recurrent and
convolution state read and written) over the memory bandwidth (``--bandwidth-gbs``, else measured
here: the best of 5 copies of a 256 MiB float32 tensor, bytes read plus written per second).

No trained checkpoint comes with the repository, and a few minutes of CPU training do not teach a
model to copy, so the random model's loops stand in (see ``speculation.py``); a trained model's
acceptance on real copying would differ.

Usage: python benchmarks/cpu_speculative.py [--preset tiny-efla] [--batches 1,8] [--new-tokens 96]
           [--rounds 5] [--threads 1] [--clock cpu] [--bandwidth-gbs G]
           [--out benchmarks/results/cpu/speculative.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import speculation
from evidence import measurement, write_run

from efla.models import EFLAForCausalLM, get_preset_config

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def copy_bandwidth_gbs(megabytes: int = 256, reps: int = 5) -> float:
    """This machine's memory bandwidth as a large copy sees it (bytes read plus written per second)."""
    src = torch.empty(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = min(speculation._timed(lambda: dst.copy_(src), time.perf_counter, lambda: None) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def kind_measurements(model, args, clock) -> tuple[list[dict], list[float]]:
    """Every kind at every batch; and the batch-1 plain step's seconds per round (from copying)."""
    found_rows, step_seconds = [], []
    for kind in speculation.KINDS:
        for batch in map(int, args.batches.split(",")):
            found = speculation.measure_case(
                model, kind, batch, args.new_tokens, args.rounds, clock, lambda: None, torch.device("cpu")
            )
            name = f"{args.preset} {kind} batch {batch}"
            found_rows += speculation.case_measurements(name, batch, found)
            print(speculation.describe(name, found), flush=True)
            if batch == 1 and kind == "copying":
                step_seconds = [1 / rate for rate in found["plain"]]
    return found_rows, step_seconds


def pass_cost_measurements(model, args, clock) -> list[dict]:
    width = speculation.SPECULATE["num_speculative_tokens"] + 1
    found = []
    for batch in map(int, args.batches.split(",")):
        ratios = speculation.pass_cost(model, batch, width, args.rounds, clock, lambda: None)
        found.append(
            measurement(
                f"{args.preset} batch {batch}, {width} positions",
                "verification pass / plain decoding step",
                "steps",
                "lower",
                ("verification pass", ratios),
                None,
            )
        )
        print(f"batch {batch}: a pass over {width} positions costs {statistics.median(ratios):.2f} plain steps", flush=True)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (robust on a machine other processes load, with --threads 1); wall: elapsed",
    )
    p.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the floor (default: measured copy bandwidth)"
    )
    p.add_argument("--out", default="benchmarks/results/cpu/speculative.json")
    args = p.parse_args()
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(args.preset)).eval()
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    measurements, step_seconds = kind_measurements(model, args, clock)
    measurements += pass_cost_measurements(model, args, clock)
    bandwidth = args.bandwidth_gbs or copy_bandwidth_gbs()
    source = (
        "given (--bandwidth-gbs)"
        if args.bandwidth_gbs
        else "measured: the best of 5 copies of a 256 MiB float32 tensor, read plus written"
    )
    step_bytes = speculation.step_bytes(model)
    floor = step_bytes / (bandwidth * 1e9)
    measurements += speculation.floor_measurements(f"{args.preset} batch 1", step_seconds, floor, args.rounds)
    print(
        f"batch-1 plain step {statistics.median(step_seconds) * 1e3:.3f} ms vs floor {floor * 1e6:.3f} us "
        f"({step_bytes:,} bytes at {bandwidth:.1f} GB/s, {source}): {statistics.median(step_seconds) / floor:,.0f}x the floor",
        flush=True,
    )
    notes = [
        "kinds (benchmarks/speculation.py): copying = 32 random tokens and their 96-token greedy continuation as the prompt "
        "(a random-weight model's greedy text loops: the output continues the loop in the prompt); code editing = the same "
        "with one continuation token in 8 replaced by a random one; free = 32 random tokens, temperature-1 sampling with "
        "per-row seeds. Greedy output checked equal to plain greedy before timing",
        "random weights (default initialisation): no trained checkpoint comes with the repository; acceptance on a trained "
        "model's copying would differ",
        f"speculate={speculation.SPECULATE} (the default turn-down rule, verify_cost "
        f"{speculation.speculative_module.DEFAULT_VERIFY_COST}); {args.new_tokens} new tokens per call; float32; "
        f"{args.threads} threads; clock: {args.clock} ({'elapsed time' if args.clock == 'wall' else 'the process CPU time'})",
        "a round times one speculative call, one with every draft verified (verify_cost=1), then one plain call, "
        "after one warm-up call of each",
        f"bandwidth {bandwidth:.1f} GB/s, {source}; step bytes {step_bytes} (weights once, state read and written)",
        f"load average at the start: {load_before} (other processes shared the machine's cores)",
    ]
    write_run(
        args.out,
        "cpu_speculative",
        "Speculative decoding (prompt lookup) vs plain generate, CPU",
        args.rounds,
        measurements,
        notes,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
