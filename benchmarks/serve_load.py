"""Serving load: continuous batching through ``efla.serving.Scheduler`` (the engine of ``efla serve``,
in process, without HTTP) under open-loop Poisson load, beside static batching through
``efla.generation.generate`` on the same requests.

Requests have random prompts of ``--prompt-min``..``--prompt-max`` tokens and make exactly
``--output-min``..``--output-max`` tokens each (no stop token; greedy), lengths drawn uniformly with a
fixed seed. Tokens are turned into text as the server does (the model's tokenizer with ``--model``;
with ``--preset`` a word-level tokenizer of the vocabulary's size, so decoding costs what it costs).

Stages:

- ``rates``: for each rate of ``--rates`` (requests per second; ``inf``: all at once), ``--requests``
  requests arrive at Poisson times (exponential gaps) whatever the server's progress (open loop).
- ``concurrency``: ``--concurrency`` streams in flight (a new request as soon as one ends) until
  ``--waves`` x ``--concurrency`` requests are served.
- ``static``: the concurrency stage's requests in batches of ``--concurrency``, each batch one
  ``generate`` call left-padded to its longest prompt and run to its longest output; its tokens/s
  counts each request's own output only (a finished row's padding steps are waste), and the padded
  total is shown beside it.

Per stage: output tokens/s over the stage's wall time, time to first token (arrival to the first token
handed out) and inter-token latency (gaps between a request's successive tokens as handed out) at
p50/p99, time per output token of a request ((last - first) / (n - 1)) at p50/p99, and peak GPU memory.
Static batching and the concurrency stage take turns for ``--rounds`` rounds (the rates stage runs in
the first only). Target: at ``--concurrency`` streams the server keeps >= 80% of static batching's
tokens/s, with p99 inter-token latency below 3x its p50 (PASS / MISS), on the rounds' medians.
Writes ``DIR/serve_load.md``, ``DIR/serve_load.json`` and the rounds in the shape of
``benchmarks/evidence.py``, ``DIR/serve_load_run.json`` (the raw file for ``benchmarks/results/serve/``).

Usage: python benchmarks/serve_load.py [--preset 340m-efla | --model DIR] [--device cuda] [--dtype bfloat16]
           [--concurrency 256] [--waves 2] [--rates 16,64,256,inf] [--requests 512] [--out DIR]
CPU smoke: python benchmarks/serve_load.py --device cpu --preset tiny-efla --concurrency 8 --waves 2
           --rates 50,inf --requests 16 --prompt-max 64 --output-min 8 --output-max 32 --out /tmp/serve_load
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from efla.generation import generate, release
from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler, TokenEvent, prefill_defaults
from evidence import write_run


@dataclass
class Job:
    prompt: list[int]
    output: int
    arrival: float = 0.0  # seconds after the stage's start
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    failed: str | None = None


def make_jobs(n: int, vocab: int, args, rng: random.Random) -> list[Job]:
    return [
        Job(
            [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
            rng.randint(args.output_min, args.output_max),
        )
        for _ in range(n)
    ]


def word_tokenizer(vocab: int):
    """A tokenizer of ``vocab`` words ``t0 t1 ...`` (decoding joins them with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def load(args):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if args.model:
        import efla  # noqa: F401  (registers the model type)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from efla.models import EFLAForCausalLM, get_preset_config

        torch.manual_seed(0)
        model = EFLAForCausalLM(get_preset_config(args.preset)).to(dtype)
        tokenizer = word_tokenizer(model.config.vocab_size)
    return model.to(args.device).eval(), tokenizer


# -- the server side ----------------------------------------------------------------------------------


class Stage:
    """One stage's requests through a scheduler, timed from the scheduler's thread."""

    def __init__(self, scheduler: Scheduler, jobs: list[Job]):
        self.scheduler, self.jobs = scheduler, jobs
        self.ended = 0
        self.done = threading.Event()
        self.start = 0.0

    def submit(self, job: Job) -> None:
        job.submitted = time.perf_counter()
        self.scheduler.submit(
            [job.prompt], SamplingParams(max_tokens=job.output), lambda _request, event, job=job: self.on_event(job, event)
        )

    def on_event(self, job: Job, event) -> None:
        if isinstance(event, (TokenEvent, FinishEvent)):  # one event per token, the last one a FinishEvent
            job.token_times.append(time.perf_counter())
        if isinstance(event, ErrorEvent):
            job.failed = event.message
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self.ended += 1
            self.finished(job)
            if self.ended == len(self.jobs):
                self.done.set()

    def finished(self, job: Job) -> None:
        pass

    def wait(self) -> float:
        self.done.wait()
        return time.perf_counter() - self.start


class OpenLoop(Stage):
    def run(self) -> float:
        self.start = time.perf_counter()
        for job in self.jobs:
            delay = self.start + job.arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self.submit(job)
        return self.wait()


class ClosedLoop(Stage):
    """``streams`` requests in flight: each one that ends submits the next (from the scheduler's thread)."""

    def __init__(self, scheduler: Scheduler, jobs: list[Job], streams: int):
        super().__init__(scheduler, jobs)
        self.streams, self.next = streams, streams
        self.lock = threading.Lock()

    def run(self) -> float:
        self.start = time.perf_counter()
        for job in self.jobs[: self.streams]:
            self.submit(job)
        return self.wait()

    def finished(self, job: Job) -> None:  # noqa: ARG002 (overrides the open-loop driver's hook)
        with self.lock:
            following = self.jobs[self.next] if self.next < len(self.jobs) else None
            self.next += 1
        if following is not None:
            self.submit(following)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def stage_row(name: str, jobs: list[Job], seconds: float, rate: str, memory: float | None) -> dict:
    tokens = sum(len(j.token_times) for j in jobs if not j.failed)
    gaps = [b - a for j in jobs for a, b in zip(j.token_times, j.token_times[1:])]
    ttft = [j.token_times[0] - j.submitted for j in jobs if j.token_times]
    tpot = [(j.token_times[-1] - j.token_times[0]) / (len(j.token_times) - 1) for j in jobs if len(j.token_times) > 1]
    return dict(
        stage=name,
        rate=rate,
        requests=len(jobs),
        failed=sum(bool(j.failed) for j in jobs),
        output_tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        ttft_ms=[1e3 * percentile(ttft, 50), 1e3 * percentile(ttft, 99)],
        itl_ms=[1e3 * percentile(gaps, 50), 1e3 * percentile(gaps, 99)],
        tpot_ms=[1e3 * percentile(tpot, 50), 1e3 * percentile(tpot, 99)],
        peak_memory_gib=memory,
    )


def new_scheduler(model, tokenizer, args) -> Scheduler:
    scheduler = Scheduler(
        model,
        tokenizer,
        max_batch=args.max_batch or args.concurrency,
        max_queue=max(args.requests, args.concurrency * args.waves),
        max_context=args.prompt_max + args.output_max + 1,
        prefill_chunk=args.prefill_chunk,
        prefill_every=args.prefill_every,
        stop_tokens=[],
        pad_token=0,
    )
    scheduler.start()
    return scheduler


def server_stages(model, tokenizer, args, rng: random.Random, concurrency_jobs: list[Job], rates: list[float]) -> list[dict]:
    rows = []
    scheduler = new_scheduler(model, tokenizer, args)
    try:
        warm = ClosedLoop(scheduler, make_jobs(min(args.concurrency, 8), model.config.vocab_size, args, rng), args.concurrency)
        warm.run()
        for rate in rates:
            jobs = make_jobs(args.requests, model.config.vocab_size, args, rng)
            arrival = 0.0
            for job in jobs:
                arrival += 0.0 if rate == float("inf") else rng.expovariate(rate)
                job.arrival = arrival
            reset_memory(args)
            seconds = OpenLoop(scheduler, jobs).run()
            rows.append(stage_row("server, Poisson arrivals", jobs, seconds, f"{rate:g}", peak_memory(args)))
            log(rows[-1], scheduler)
        reset_memory(args)
        seconds = ClosedLoop(scheduler, concurrency_jobs, args.concurrency).run()
        rows.append(stage_row(f"server, {args.concurrency} streams", concurrency_jobs, seconds, "closed loop", peak_memory(args)))
        log(rows[-1], scheduler)
    finally:
        scheduler.close()
    return rows


# -- static batching ----------------------------------------------------------------------------------


def static_stage(model, jobs: list[Job], args) -> dict:
    batches = [jobs[i : i + args.concurrency] for i in range(0, len(jobs), args.concurrency)]
    calls = [left_padded(batch, args.device) for batch in batches]
    generate(model, *calls[0], max_new_tokens=2, eos_token_id=[])  # warm-up (captures)
    reset_memory(args)
    padded = 0
    start = time.perf_counter()
    for batch, (ids, mask) in zip(batches, calls):
        longest = max(j.output for j in batch)
        generate(model, ids, mask, max_new_tokens=longest, eos_token_id=[])
        padded += longest * len(batch)
    synchronize(args)
    seconds = time.perf_counter() - start
    useful = sum(j.output for j in jobs)
    row = dict(
        stage=f"static generate, batches of {args.concurrency}",
        rate="-",
        requests=len(jobs),
        failed=0,
        output_tokens=useful,
        seconds=seconds,
        tokens_per_s=useful / seconds,
        padded_tokens_per_s=padded / seconds,
        ttft_ms=None,
        itl_ms=None,
        tpot_ms=None,
        peak_memory_gib=peak_memory(args),
    )
    release(model)
    log(row)
    return row


def left_padded(batch: list[Job], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(j.prompt) for j in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, job in enumerate(batch):
        ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt)
        mask[row, width - len(job.prompt) :] = 1
    return ids.to(device), mask.to(device)


# -- report -------------------------------------------------------------------------------------------


def reset_memory(args) -> None:
    if args.device.startswith("cuda"):
        synchronize(args)
        torch.cuda.reset_peak_memory_stats()


def peak_memory(args) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None


def synchronize(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def log(row: dict, scheduler: Scheduler | None = None) -> None:
    loop = f"; scheduler loop seconds so far {scheduler.status()['loop_seconds']}" if scheduler else ""
    print(f"  {row['stage']} ({row['rate']}): {row['tokens_per_s']:,.0f} tokens/s{loop}", flush=True)


def pair(values, spec: str = ".1f") -> str:
    return "-" if values is None else " / ".join(format(v, spec) for v in values)


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| stage | rate (req/s) | requests | output tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | "
        "per-token p50 / p99 ms | peak GPU memory GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}"
        if "padded_tokens_per_s" in r:
            tps += f" ({r['padded_tokens_per_s']:,.0f} padded)"
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['stage']} | {r['rate']} | {r['requests']}{failed} | {tps} | {pair(r['ttft_ms'])} | "
            f"{pair(r['itl_ms'], '.2f')} | {pair(r['tpot_ms'], '.2f')} | {memory} |"
        )
    return lines


def targets(server: dict, static: dict) -> tuple[list[str], dict]:
    ratio = server["tokens_per_s"] / static["tokens_per_s"]
    spread = server["itl_ms"][1] / server["itl_ms"][0] if server["itl_ms"][0] > 0 else float("inf")
    checks = {"throughput_vs_static": (ratio, ratio >= 0.8), "itl_p99_over_p50": (spread, spread < 3)}
    lines = [
        f"- {server['stage']}: {ratio:.2f}x static batching's tokens/s (target >= 0.80): {'PASS' if ratio >= 0.8 else 'MISS'}",
        f"- {server['stage']}: inter-token latency p99 / p50 = {spread:.2f} (target < 3): {'PASS' if spread < 3 else 'MISS'}",
    ]
    return lines, {k: {"value": v, "pass": ok} for k, (v, ok) in checks.items()}


def measurements(server: list[dict], static: list[dict]) -> list[dict]:
    """The server's closed-loop stage against static batching on the same requests, round by round
    (the two took turns), and the server's latencies per round."""
    from evidence import measurement

    case = f"{server[0]['requests']} requests, {server[0]['stage']} against {static[0]['stage']}"
    found = [
        measurement(
            case,
            "output throughput",
            "tokens/s",
            "higher",
            ("efla serve's scheduler (in process)", [r["tokens_per_s"] for r in server]),
            ("static efla.generation.generate", [r["tokens_per_s"] for r in static]),
        )
    ]
    for key, what in (
        ("ttft_ms", "time to first token"),
        ("itl_ms", "inter-token latency"),
        ("tpot_ms", "time per output token"),
    ):
        for i, q in enumerate(("p50", "p99")):
            found.append(measurement(case, f"{what}, {q}", "ms", "lower", ("server", [r[key][i] for r in server]), None))
    return found


def median_row(rows: list[dict]) -> dict:
    """The rounds' medians of throughput and inter-token latency (what the targets read)."""
    itl = None if rows[0]["itl_ms"] is None else [statistics.median(r["itl_ms"][i] for r in rows) for i in (0, 1)]
    return dict(rows[0], tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows), itl_ms=itl)


def rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--preset", default="340m-efla", help="a preset with random weights")
    source.add_argument("--model", default=None, help="a saved model directory instead of --preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on the CPU"
    )
    ap.add_argument("--concurrency", type=int, default=256, help="streams of the concurrency stage, static batch size")
    ap.add_argument("--waves", type=int, default=2, help="concurrency stage: requests = waves x concurrency")
    ap.add_argument("--max-batch", type=int, default=None, help="scheduler slots (default: --concurrency)")
    ap.add_argument("--rates", type=rates, default=rates("16,64,256,inf"), help="request rates of the rates stage")
    ap.add_argument("--requests", type=int, default=512, help="requests per rate")
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--output-min", type=int, default=32)
    ap.add_argument("--output-max", type=int, default=512)
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="scheduler: prompt tokens per prefill call (default: efla.serving.prefill_defaults)",
    )
    ap.add_argument(
        "--prefill-every",
        type=int,
        default=None,
        help="scheduler: decoding steps between prefill calls while half the slots or more decode "
        "(default: efla.serving.prefill_defaults)",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of static batching then the concurrency stage (the rates stage: the first only)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="default: $OUT or the current directory")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    chunk, every = prefill_defaults(torch.device(args.device))
    args.prefill_chunk = args.prefill_chunk or chunk
    args.prefill_every = args.prefill_every or every
    if not 1 <= args.prompt_min <= args.prompt_max or not 1 <= args.output_min <= args.output_max:
        ap.error("expected 1 <= --prompt-min <= --prompt-max and 1 <= --output-min <= --output-max")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    model, tokenizer = load(args)
    rng = random.Random(args.seed)
    concurrency_jobs = make_jobs(args.concurrency * args.waves, model.config.vocab_size, args, rng)
    print(f"{args.model or args.preset} on {args.device} ({args.dtype}): static batching, then the server", flush=True)
    rows, closed, static = [], [], []
    for r in range(args.rounds):
        jobs = [Job(j.prompt, j.output) for j in concurrency_jobs]  # the same requests, no times from a round before
        release(model)  # static batching starts as in the first round, without the server's decoding state
        gc.collect()
        static.append(dict(static_stage(model, jobs, args), round=r))
        gc.collect()
        served = server_stages(model, tokenizer, args, rng, jobs, args.rates if r == 0 else [])
        closed.append(served[-1])
        rows += [dict(row, round=r) for row in served] + [static[-1]]
    target_lines, checks = targets(median_row(closed), median_row(static))
    info = dict(
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        command=" ".join(sys.argv),
        model=args.model or args.preset,
        dtype=args.dtype,
        prompt_tokens=[args.prompt_min, args.prompt_max],
        output_tokens=[args.output_min, args.output_max],
        prefill_chunk=args.prefill_chunk,
        prefill_every=args.prefill_every,
        threads=torch.get_num_threads(),
    )
    lines = ["# Serving load", "", *(f"- {k}: {v}" for k, v in info.items()), "", *table(rows), "", *target_lines]
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "serve_load.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "serve_load.json"), "w") as fh:
        json.dump(dict(info=info, rows=rows, targets=checks), fh, indent=1)
    open_loop = [
        f"{r['stage']} at {r['rate']} requests/s (one round): {r['tokens_per_s']:,.0f} tokens/s"
        for r in rows
        if r["stage"].endswith("arrivals")
    ]
    notes = [
        f"model {info['model']}, {info['dtype']}, prompts {args.prompt_min}-{args.prompt_max} tokens, outputs "
        f"{args.output_min}-{args.output_max} tokens, greedy; prefill chunk {args.prefill_chunk}, every {args.prefill_every}",
        "in process: the scheduler of efla serve, no HTTP; each round runs static batching, then the server on the same requests",
        *open_loop,
    ]
    write_run(
        os.path.join(args.out, "serve_load_run.json"),
        "serve_load",
        f"Serving load, {info['model']}",
        args.rounds,
        measurements(closed, static),
        notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
