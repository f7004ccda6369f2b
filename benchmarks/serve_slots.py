"""Decoding step time of the serving scheduler against its slot count (``--max-batch``), CPU.

A server's speed for the same running streams should not depend on how many state slots it has.
Each measurement is a fresh process (what a user starting ``efla serve --max-batch N`` gets: the
threads of the process are part of what is measured), running ``efla.serving.Scheduler`` (the engine
of ``efla serve``, without HTTP) over a preset's random weights, float32, on the CPU: ``--streams``
requests of a ``--prompt``-token prompt each decode ``--tokens`` tokens (greedy, no stop token),
started together. The time per decoding step is a stream's (last token's time - first token's time)
/ (tokens - 1), the median over the streams. Slot counts alternate within each round; each of the
smaller slot counts is compared with the 64-slot server of the same round.

Usage: python benchmarks/serve_slots.py [--slots 1,2,8,16,64] [--streams 1,2] [--rounds 3] [--tokens 64]
           [--out benchmarks/results/serve/serve_slots.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

BASELINE_SLOTS = 64


def worker(args) -> None:
    """One fresh server: print the median time per decoding step (ms) of its streams as JSON."""
    import torch

    from efla.models import EFLAForCausalLM, get_preset_config
    from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler, TokenEvent

    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(args.preset)).eval()
    scheduler = Scheduler(model, None, max_batch=args.worker_slots, max_context=args.prompt + args.tokens + 2)
    scheduler.start()
    times: dict[int, list[float]] = {}
    ended = threading.Semaphore(0)

    def on_event(request, event) -> None:
        if isinstance(event, (TokenEvent, FinishEvent)):
            times.setdefault(request.index, []).append(time.perf_counter())
        if isinstance(event, (FinishEvent, ErrorEvent)):
            ended.release()

    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = [3 + i % 200 for i in range(args.prompt)]
    for _ in range(args.worker_streams):
        scheduler.submit([prompt], params, on_event)
    for _ in range(args.worker_streams):
        ended.acquire()
    scheduler.close(30)
    per_step = [(t[-1] - t[0]) / (len(t) - 1) * 1000 for t in times.values()]
    print(json.dumps({"ms_per_step": statistics.median(per_step), "steps": scheduler.steps}))


def measure(slots: int, streams: int, args) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--worker-slots", str(slots), "--worker-streams", str(streams)]
    command += ["--preset", args.preset, "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms_per_step"]


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} ms (min {min(values):.2f}, max {max(values):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--slots", default="1,2,8,16,64", help="slot counts (--max-batch), comma-separated")
    p.add_argument("--streams", default="1,2", help="running streams, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens each stream decodes")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of each stream")
    p.add_argument("--out", default=None, help="write the run here (benchmarks/evidence.py's shape)")
    p.add_argument("--worker-slots", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-streams", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_slots is not None:
        worker(args)
        return 0
    slot_counts = [int(s) for s in args.slots.split(",")]
    stream_counts = [int(s) for s in args.streams.split(",")]
    cases = [(slots, streams) for streams in stream_counts for slots in slot_counts if streams <= slots]
    results: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    for round_ in range(args.rounds):
        for case in cases:
            results[case].append(measure(*case, args))
            print(f"round {round_ + 1}: {case[1]} streams, {case[0]} slots: {results[case][-1]:.2f} ms/step", flush=True)
    from evidence import measurement, write_run

    measurements = []
    for (slots, streams), values in results.items():
        print(f"{streams} streams, {slots:>2} slots: {spread(values)}")
        baseline = results.get((BASELINE_SLOTS, streams))
        compared = (f"{BASELINE_SLOTS} slots", baseline) if baseline is not None and slots != BASELINE_SLOTS else None
        case = f"{streams} running streams, {slots} slots"
        measurements.append(measurement(case, "time per decoding step", "ms", "lower", (f"{slots} slots", values), compared))
    if args.out:
        notes = [
            f"{args.preset}, float32, CPU, torch threads: the default; each measurement a fresh process; "
            f"{args.tokens} tokens per stream after a {args.prompt}-token prompt; "
            "a step: a stream's (last - first token time) / (tokens - 1)"
        ]
        write_run(
            args.out, "serve_slots", "Serving decoding step time against --max-batch (CPU)", args.rounds, measurements, notes
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
