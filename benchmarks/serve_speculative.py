"""Speculative decoding in the serving scheduler: ``Scheduler(speculate={"method": "ngram"})`` (what
``efla serve --speculate ngram`` runs, speculation turning itself down where a pass does not pay)
against the same scheduler without it, and against one verifying every draft (``verify_cost=1``: the
control), in process (no HTTP), a tiny preset's random weights, float32, on the CPU.

Per case and stream count, every round submits the same ``--streams`` requests at once to each
server in turn (speculative, control, plain, each round starting with the next; ``--slots`` state
slots each, so more streams than slots wait for one) and times until the last one ends, on the wall
clock and in the process's CPU time (the scheduler runs in a thread of this process; the CPU time is
less disturbed by other processes on the machine); new tokens/s is all requests' tokens over that time (prefill included:
the first token comes from the prompt's pass). Cases:

- ``repeating``: greedy requests whose prompts hold 32 random tokens and a first run of the model's
  own greedy text (32 tokens; a random model's greedy text loops, and prompt lookup drafts the loop).
- ``copying``, ``code editing``, ``free``: ``benchmarks/speculation.py``'s kinds, as ``generate``'s
  benchmark runs them (a 96-token greedy continuation in the prompt, the same with one token in 8
  edited, and temperature-1 sampling from random prompts, seeded per request).

The greedy tokens are checked equal to the plain server's before timing. Also per case: the
acceptance rate (kept / drafted tokens verified), the share of rounds that verified (the rest were
plain steps) and new tokens per round of a request.

Usage: python benchmarks/serve_speculative.py [--preset tiny-efla] [--streams 1,8,16] [--slots 8] [--tokens 96]
           [--rounds 5] [--threads 1] [--cases repeating,copying,...] [--out benchmarks/results/serve/serve_speculative.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import speculation
from alternate import load_average
from evidence import measurement, write_run

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config
from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler

SPECULATE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
ALWAYS = dict(SPECULATE, verify_cost=1)
SIDES = {
    "speculative": "efla serve --speculate ngram",
    "always": "efla serve --speculate ngram, every draft verified (verify_cost=1)",
    "plain": "efla serve",
}
CASES = ("repeating", *speculation.KINDS)
REPEATING_PROMPT = 32


def prompts(model, case: str, streams: int) -> list[list[int]]:
    if case != "repeating":
        return speculation.prompts(model, case, streams, "cpu").tolist()
    g = torch.Generator().manual_seed(streams)
    ids = torch.randint(3, model.config.vocab_size, (streams, REPEATING_PROMPT), generator=g)
    return generate(model, ids, max_new_tokens=REPEATING_PROMPT, eos_token_id=[]).tolist()  # a first run of the greedy text


def params(case: str, tokens: int, i: int) -> SamplingParams:
    if case == "free":
        return SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)
    return SamplingParams(max_tokens=tokens)


def serve_all(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds from submitting every request to the end of the last, and their tokens."""
    ended = threading.Semaphore(0)

    def on_event(_request, event) -> None:
        if isinstance(event, (FinishEvent, ErrorEvent)):
            ended.release()

    start, cpu_start = time.perf_counter(), time.process_time()
    submitted = [scheduler.submit([prompt], p, on_event)[0] for prompt, p in requests]
    for _ in submitted:
        ended.acquire()
    return time.perf_counter() - start, time.process_time() - cpu_start, [r.tokens for r in submitted]


def run_case(model, servers: dict[str, Scheduler], case: str, streams: int, args) -> list[dict]:
    requests = [(prompt, params(case, args.tokens, i)) for i, prompt in enumerate(prompts(model, case, streams))]
    warm = {side: serve_all(server, requests)[2] for side, server in servers.items()}
    if case != "free" and not warm["speculative"] == warm["always"] == warm["plain"]:
        raise SystemExit(f"{case}, {streams} streams: the speculating server's greedy tokens differ from the plain server's")
    wall, cpu = {side: [] for side in servers}, {side: [] for side in servers}
    figures = {"acceptance rate": [], "rounds that verified (the rest: plain steps)": [], "new tokens per round of a request": []}
    sides = list(servers)
    for i in range(args.rounds):
        before = servers["speculative"].speculation.stats()
        for side in sides[i % 3 :] + sides[: i % 3]:  # each server first in turn: no side always runs after the others
            server = servers[side]
            wall_seconds, cpu_seconds, outputs = serve_all(server, requests)
            tokens = sum(map(len, outputs))
            wall[side].append(tokens / wall_seconds)
            cpu[side].append(tokens / cpu_seconds)
            if side == "speculative":
                counts = {k: v - before[k] for k, v in server.speculation.stats().items() if k != "method"}
                figures["acceptance rate"].append(counts["accepted"] / max(1, counts["drafted"]))
                figures["rounds that verified (the rest: plain steps)"].append(counts["verified"] / counts["rounds"])
                figures["new tokens per round of a request"].append((tokens - streams) / counts["row_rounds"])  # first: prefill's
    name = f"{args.preset} {case} {streams} streams"
    print(f"{name}: {describe(wall, cpu, figures)}", flush=True)
    plain = lambda values: (SIDES["plain"], values["plain"])  # noqa: E731
    rows = []
    for metric, values in (("new tokens/s", wall), ("new tokens per CPU second", cpu)):
        for side in ("speculative", "always"):
            rows.append(measurement(name, metric, "tokens/s", "higher", (SIDES[side], values[side]), plain(values)))
    units = ("fraction", "fraction", "tokens")
    rows += [measurement(name, m, u, "higher", (SIDES["speculative"], v), None) for (m, v), u in zip(figures.items(), units)]
    return rows


def describe(wall: dict, cpu: dict, figures: dict) -> str:
    def ratio(values: dict, side: str) -> str:
        r = [a / b for a, b in zip(values[side], values["plain"])]
        return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"

    return (
        f"wall {ratio(wall, 'speculative')} (every draft verified {ratio(wall, 'always')}), "
        f"CPU {ratio(cpu, 'speculative')} (every draft verified {ratio(cpu, 'always')}); "
        + ", ".join(f"{m} {statistics.median(v):.2f}" for m, v in figures.items())
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--streams", default="1,8,16")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default="benchmarks/results/serve/serve_speculative.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(args.preset)).eval()
    streams = [int(s) for s in args.streams.split(",")]
    longest_prompt = speculation.PROMPT + speculation.CONTINUATION
    options = {"max_batch": args.slots, "max_context": longest_prompt + args.tokens + 8, "seed": 0}
    servers = {
        "speculative": Scheduler(model, None, speculate=SPECULATE, **options),
        "always": Scheduler(model, None, speculate=ALWAYS, **options),
        "plain": Scheduler(model, None, **options),
    }
    for server in servers.values():
        server.start()
    try:
        cases = args.cases.split(",")
        measurements = [m for case in cases for n in streams for m in run_case(model, servers, case, n, args)]
    finally:
        for server in servers.values():
            server.close(30)
    notes = [
        "in process: efla.serving.Scheduler without HTTP; the three servers share the model, each with its own state pool",
        f"repeating: greedy; each prompt {REPEATING_PROMPT} random tokens plus their {REPEATING_PROMPT}-token greedy "
        "continuation; copying, code editing, free: benchmarks/speculation.py's kinds; greedy tokens checked equal to "
        "the plain server's before timing",
        "free: temperature-1 sampling, seed i for request i; each speculative server's own draws",
        f"speculate={SPECULATE} (default verify_cost); the control adds verify_cost=1; {args.tokens} new tokens per "
        f"request, no stop token; {args.slots} slots (more streams wait for one); float32; {args.threads} thread(s)",
        "a round serves the requests on each server in turn, round i starting with the (i mod 3)-th of speculative, "
        "control, plain; one warm-up each before",
        "new tokens per CPU second: the process's CPU time (time.process_time) over the same interval",
        f"load average before: {load_before} (2 cores, shared with other processes)",
    ]
    write_run(args.out, "serve_speculative", "Speculative decoding in the serving scheduler", args.rounds, measurements, notes)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
