"""Speculative decoding in the serving scheduler: ``Scheduler(speculate={"method": "ngram"})`` (what
``efla serve --speculate ngram`` runs) against the same scheduler without it, in process (no HTTP),
a tiny preset's random weights, float32, on the CPU.

Per case and stream count, every round submits the same ``--streams`` requests at once to each
server in turn (the speculative one first) and times until the last one ends; new tokens/s is all
requests' tokens over that time (prefill included: the first token comes from the prompt's pass).
Cases, as ``benchmarks/cpu_speculative.py``'s:

- ``repeating``: greedy requests whose prompts hold a first run of the model's own greedy text (a
  random model's greedy text loops, and prompt lookup drafts the loop): the stand-in for copying
  out of the prompt. The greedy tokens are checked equal to the plain server's before timing.
- ``free``: sampling at temperature 1 from random prompts (seeded per request): lookup finds few
  drafts and most are rejected; the adaptive draft length and pauses must keep the loss small.

Also per case: the acceptance rate (kept / drafted) and new tokens per round of a request.

Usage: python benchmarks/serve_speculative.py [--preset tiny-efla] [--streams 1,8] [--tokens 96]
           [--rounds 5] [--threads 2] [--out benchmarks/results/serve/serve_speculative.json]
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

from evidence import measurement, write_run

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config
from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler

SPECULATE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPT_TOKENS = 32


def prompts(model, case: str, streams: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(streams)
    ids = torch.randint(3, model.config.vocab_size, (streams, PROMPT_TOKENS), generator=g)
    if case == "repeating":
        ids = generate(model, ids, max_new_tokens=PROMPT_TOKENS, eos_token_id=[])  # a first run of the greedy text
    return ids.tolist()


def params(case: str, tokens: int, i: int) -> SamplingParams:
    if case == "free":
        return SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)
    return SamplingParams(max_tokens=tokens)


def serve_all(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> tuple[float, list[list[int]]]:
    """Seconds from submitting every request to the end of the last, and their tokens."""
    ended = threading.Semaphore(0)

    def on_event(_request, event) -> None:
        if isinstance(event, (FinishEvent, ErrorEvent)):
            ended.release()

    start = time.perf_counter()
    submitted = [scheduler.submit([prompt], p, on_event)[0] for prompt, p in requests]
    for _ in submitted:
        ended.acquire()
    return time.perf_counter() - start, [r.tokens for r in submitted]


def run_case(model, servers: dict[str, Scheduler], case: str, streams: int, args) -> list[dict]:
    requests = [(prompt, params(case, args.tokens, i)) for i, prompt in enumerate(prompts(model, case, streams))]
    fast, plain = servers["speculative"], servers["plain"]
    warm_fast, warm_plain = serve_all(fast, requests)[1], serve_all(plain, requests)[1]
    if case == "repeating" and warm_fast != warm_plain:
        raise SystemExit(f"{case}, {streams} streams: the speculating server's greedy tokens differ from the plain server's")
    ours, baseline, acceptance, per_round = [], [], [], []
    for _ in range(args.rounds):
        before = fast.speculation.stats()
        seconds, outputs = serve_all(fast, requests)
        after = fast.speculation.stats()
        tokens = sum(map(len, outputs))
        ours.append(tokens / seconds)
        plain_seconds, plain_outputs = serve_all(plain, requests)
        baseline.append(sum(map(len, plain_outputs)) / plain_seconds)
        drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
        acceptance.append(accepted / max(1, drafted))
        per_round.append((tokens - streams) / max(1, after["row_rounds"] - before["row_rounds"]))  # the first tokens: prefill's
    name = f"{args.preset} {case} {streams} streams"
    ratio = [a / b for a, b in zip(ours, baseline)]
    print(
        f"{name}: {statistics.median(ours):,.0f} vs {statistics.median(baseline):,.0f} tokens/s, ratio "
        f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}), acceptance {statistics.median(acceptance):.2f}",
        flush=True,
    )
    side = "efla serve --speculate ngram"
    return [
        measurement(name, "new tokens/s", "tokens/s", "higher", (side, ours), ("efla serve", baseline)),
        measurement(name, "acceptance rate", "fraction", "higher", (side, acceptance), None),
        measurement(name, "new tokens per round of a request", "tokens", "higher", (side, per_round), None),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/serve/serve_speculative.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(args.preset)).eval()
    streams = [int(s) for s in args.streams.split(",")]
    options = {"max_batch": max(streams), "max_context": 2 * PROMPT_TOKENS + args.tokens + 8, "seed": 0}
    servers = {"speculative": Scheduler(model, None, speculate=SPECULATE, **options), "plain": Scheduler(model, None, **options)}
    for server in servers.values():
        server.start()
    try:
        measurements = [m for case in ("repeating", "free") for n in streams for m in run_case(model, servers, case, n, args)]
    finally:
        for server in servers.values():
            server.close(30)
    notes = [
        "in process: efla.serving.Scheduler without HTTP; the two servers share the model, each with its own state pool",
        f"repeating: greedy; each prompt {PROMPT_TOKENS} random tokens plus their {PROMPT_TOKENS}-token greedy continuation; "
        "tokens checked equal to the plain server's before timing",
        "free: temperature-1 sampling from 32 random tokens, seed i for request i; the speculative server's own draws",
        f"speculate={SPECULATE}; {args.tokens} new tokens per request, no stop token; float32; {args.threads} threads",
        "a round serves the requests on the speculative server, then on the plain one; one warm-up each before",
    ]
    write_run(args.out, "serve_speculative", "Speculative decoding in the serving scheduler", args.rounds, measurements, notes)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
