"""Serving load: continuous batching through ``efla.serving.Scheduler`` (the engine of ``efla serve``),
in process and over HTTP, beside static batching through ``efla.generation.generate`` on the same
requests.

Requests have random prompts of ``--prompt-min``..``--prompt-max`` tokens and make exactly
``--output-min``..``--output-max`` tokens each (no stop token; greedy), lengths drawn uniformly with a
fixed seed. Tokens are turned into text as the server does (the model's tokenizer with ``--model``;
with ``--preset`` a word-level tokenizer of the vocabulary's size, so decoding costs what it costs).

Stages (``--stages``, all by default); each round runs, in this order, on the same
``--waves`` x ``--concurrency`` requests:

- ``static``: batches of ``--concurrency`` requests, each one ``generate`` call left-padded to its
  longest prompt and run to its longest output, twice: in arrival order, then sorted by output length
  (a batcher that knows every request's length pads least). Every batch of both orders is run once
  untimed first (compilation, CUDA graph capture, Triton's tuning), then timed. Each batch's prefill
  is timed apart in a call of one new token (``generate(..., max_new_tokens=1)``, synchronised), so
  decoding's time is the whole call's less it. Tokens/s counts each request's own output only over
  the whole calls (a finished row's padding steps are waste; the padded rate is shown beside it).
- ``server``: the scheduler driven in process (no HTTP): ``--concurrency`` streams in flight, a new
  request as soon as one ends (closed loop).
- ``http``: the same through ``efla serve``'s app (``create_app`` on uvicorn, as ``efla serve`` runs
  it) on a loopback port, driven by ``--http-clients`` processes of streaming clients
  (``benchmarks/serve_client.py``: httpx, ``--concurrency`` streams in all).
- ``rates`` (first round only): for each rate of ``--rates`` (requests per second; ``inf``: all at
  once), ``--requests`` requests arrive at Poisson times (open loop) at the scheduler in process.
- ``profile`` (after the rounds): the closed loop once more with Python's profiler on the
  scheduler's thread (its host work by function) and torch's profiler over the scheduler's
  iterations ``--profile-steps`` (ops on the host and the device); small tables, no trace.

For the server: output tokens/s over the stage's wall time, time to first token (send to the first
token or event), inter-token latency (gaps between a request's tokens as handed out, or its events as
a client reads them) at p50/p99 and their ratio, time per output token ((last - first) / (n - 1)), and
the scheduler loop's time per decoding step by phase (``Scheduler.phase_seconds``: decode launches
the step, deliver waits for the step before and hands its tokens out as text and events, admit,
prefill, rebuild). Target: at ``--concurrency`` streams the server keeps >= 80% of the better static
batching's tokens/s with inter-token p99 / p50 <= 3 (PASS / MISS, on the medians of the per-round
values). Every stage's tokens are checked against static batching's in arrival order (the same
tokens, or over HTTP the same text). Writes ``DIR/serve_load.md``, ``DIR/serve_load.json`` (every
row), ``DIR/serve_profile.json`` and ``DIR/serve_load_run.json`` (the rounds in the shape of
``benchmarks/evidence.py``, for ``benchmarks/results/serve/``), again after every round.

Usage: python benchmarks/serve_load.py [--preset 340m-efla | --model DIR] [--device cuda] [--dtype bfloat16]
           [--concurrency 256] [--waves 2] [--rates 64,inf] [--requests 512] [--rounds 3] [--out DIR]
CPU smoke: python benchmarks/serve_load.py --device cpu --preset tiny-efla --concurrency 4 --waves 2
           --rates inf --requests 8 --prompt-min 4 --prompt-max 16 --output-min 4 --output-max 8
           --http-clients 2 --profile-steps 2,4 --out /tmp/serve_load
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import importlib.util
import json
import os
import pstats
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from efla.generation import engine_for, generate, release
from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler, TokenEvent, prefill_defaults
from evidence import measurement, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, "benchmarks", "serve_client.py")
STAGES = ("static", "server", "http", "rates", "profile")
HTTP_MODULES = ("fastapi", "uvicorn", "httpx", "prometheus_client", "jinja2")
PHASES = ("decode", "deliver", "admit", "prefill", "rebuild")
ARRIVAL, SORTED, SERVER, HTTP = "static-arrival", "static-sorted", "server", "http"
NAMES = {
    ARRIVAL: "static generate, arrival order",
    SORTED: "static generate, sorted by output length",
    SERVER: "efla serve's scheduler (in process)",
    HTTP: "efla serve over HTTP (streaming clients)",
}
BEST_STATIC = "static generate, the faster order of the round"
MODEL_NAME = "bench"  # the served model's name in the HTTP stage
STAGE_TIMEOUT_S = 300  # a stage at 256 streams ends in seconds on a GPU


@dataclass
class Job:
    prompt: list[int]
    output: int
    arrival: float = 0.0  # seconds after the stage's start
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str | None = None  # over HTTP: what the client received
    counted: int = 0  # output tokens as counted by the stage (its request's tokens, or HTTP's usage)
    failed: str | None = None


def make_jobs(n: int, vocab: int, args, rng: random.Random) -> list[Job]:
    return [
        Job(
            [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
            rng.randint(args.output_min, args.output_max),
        )
        for _ in range(n)
    ]


def fresh(jobs: list[Job]) -> list[Job]:
    """The same requests with nothing measured yet."""
    return [Job(j.prompt, j.output) for j in jobs]


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


# -- the server in process ----------------------------------------------------------------------------


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
            [job.prompt],
            SamplingParams(max_tokens=job.output),
            lambda request, event, job=job: self.on_event(job, request, event),
        )

    def on_event(self, job: Job, request, event) -> None:
        if isinstance(event, (TokenEvent, FinishEvent)):  # one event per token, the last one a FinishEvent
            job.token_times.append(time.perf_counter())
        if isinstance(event, ErrorEvent):
            job.failed = event.message
        if isinstance(event, (FinishEvent, ErrorEvent)):
            job.tokens = list(request.tokens)
            job.counted = len(job.tokens)
            self.ended += 1
            self.finished(job)
            if self.ended == len(self.jobs):
                self.done.set()

    def finished(self, job: Job) -> None:
        pass

    def wait(self) -> float:
        if not self.done.wait(STAGE_TIMEOUT_S):  # ended (failed) before a visit's time limit takes the other stages
            raise RuntimeError(f"{len(self.jobs) - self.ended} of {len(self.jobs)} requests did not end in {STAGE_TIMEOUT_S} s")
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


def new_scheduler(model, tokenizer, args, kind: type[Scheduler] = Scheduler, start: bool = True) -> Scheduler:
    """A scheduler as ``efla serve`` makes one (no prefix cache: the prompts are random), with no stop
    token, so every request makes exactly its ``max_tokens``; started unless ``start`` is false."""
    scheduler = kind(
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
    if start:
        scheduler.start()
    return scheduler


def loop_counters(scheduler: Scheduler) -> dict:
    """What the scheduler has counted so far: its loop's seconds by phase, steps, prefill calls."""
    return dict(scheduler.phase_seconds, steps=scheduler.steps, prefill_calls=scheduler.prefill_calls)


def wait_idle(scheduler: Scheduler, timeout: float = 5.0) -> None:
    """Until the loop has ended its last iteration (its last request's event comes before it)."""
    deadline = time.monotonic() + timeout
    while scheduler.status()["decoding"] and time.monotonic() < deadline:
        time.sleep(0.001)


def loop_split(scheduler: Scheduler, before: dict) -> dict:
    """The scheduler loop's time per decoding step by phase since ``before`` (``loop_counters``)."""
    wait_idle(scheduler)
    after = loop_counters(scheduler)
    steps = after["steps"] - before["steps"]
    per_step = {phase: 1e3 * (after[phase] - before[phase]) / max(steps, 1) for phase in PHASES}
    return dict(
        steps=steps,
        prefill_calls=after["prefill_calls"] - before["prefill_calls"],
        loop_ms_per_step=dict(per_step, total=sum(per_step.values())),
    )


def server_stages(model, tokenizer, args, rng: random.Random, jobs: list[Job], rates: list[float]) -> list[dict]:
    """The open-loop ``rates`` (may be none), then the closed loop over ``jobs`` (when the server stage
    runs), on one scheduler warmed by a few requests."""
    rows = []
    scheduler = new_scheduler(model, tokenizer, args)
    try:
        ClosedLoop(scheduler, make_jobs(min(args.concurrency, 8), model.config.vocab_size, args, rng), args.concurrency).run()
        for rate in rates:
            rows.append(rate_stage(scheduler, model, args, rng, rate))
        if "server" in args.stages:
            reset_memory(args)
            before = loop_counters(scheduler)
            seconds = ClosedLoop(scheduler, jobs, args.concurrency).run()
            label = f"server in process, {args.concurrency} streams"
            rows.append(stage_row(SERVER, label, jobs, seconds, "closed loop", args) | loop_split(scheduler, before))
            log(rows[-1])
    finally:
        scheduler.close()
    return rows


def rate_stage(scheduler: Scheduler, model, args, rng: random.Random, rate: float) -> dict:
    jobs = make_jobs(args.requests, model.config.vocab_size, args, rng)
    arrival = 0.0
    for job in jobs:
        arrival += 0.0 if rate == float("inf") else rng.expovariate(rate)
        job.arrival = arrival
    reset_memory(args)
    seconds = OpenLoop(scheduler, jobs).run()
    row = stage_row("rates", "server in process, Poisson arrivals", jobs, seconds, f"{rate:g}", args)
    log(row)
    return row


# -- the server over HTTP -----------------------------------------------------------------------------


@contextlib.contextmanager
def http_server(scheduler: Scheduler, tokenizer, model_name: str):
    """``efla serve``'s app and uvicorn server for ``scheduler`` on a free loopback port, in a thread of
    this process (as ``efla serve`` runs the scheduler's thread beside uvicorn's); its URL. Stopping
    it closes the scheduler."""
    from efla.serving import create_app
    from efla.serving.server import ConnectionLimits, DrainingServer, server_config

    app = create_app(scheduler, tokenizer, model_name=model_name)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    server = DrainingServer(server_config(app, ConnectionLimits(), log_level="warning"), scheduler, grace=5.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def client_processes(url: str, jobs: list[Job], args):
    """``--http-clients`` processes, each with every n-th job and its share of the streams, warmed up
    (connections open) and waiting for the word to start; any still running at the end are killed."""
    count = min(args.http_clients, args.concurrency)
    clients = []
    try:
        for i in range(count):
            streams = args.concurrency // count + (i < args.concurrency % count)
            config = dict(url=url, model=MODEL_NAME, streams=streams, jobs=[[j.prompt, j.output] for j in jobs[i::count]])
            clients.append(subprocess.Popen([sys.executable, CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            clients[-1].stdin.write(json.dumps(config) + "\n")
            clients[-1].stdin.flush()
        for client in clients:
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process did not start (exit status {client.wait()})")
        yield clients
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()


def run_clients(clients: list[subprocess.Popen], jobs: list[Job]) -> tuple[float, list[float]]:
    """Starts every client at once and waits for them; fills in the jobs. Returns the stage's seconds
    (the first client's start to the last one's end) and each client's CPU share of its run."""
    for client in clients:
        client.stdin.write("go\n")
        client.stdin.flush()
    reports = []
    for client in clients:
        line = client.stdout.readline()
        if client.wait() != 0 or not line:
            raise RuntimeError(f"a client process failed (exit status {client.returncode})")
        reports.append(json.loads(line))
    count = len(clients)
    for i, report in enumerate(reports):
        for job, result in zip(jobs[i::count], report["results"]):
            job.submitted, job.token_times, job.text = result["sent"], result["times"], result["text"]
            job.counted, job.failed = result["tokens"] or 0, result["error"]
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return seconds, [r["cpu_seconds"] / (r["end"] - r["start"]) for r in reports]


def http_stage(model, tokenizer, args, jobs: list[Job]) -> dict:
    scheduler = new_scheduler(model, tokenizer, args)
    try:
        with http_server(scheduler, tokenizer, MODEL_NAME) as url, client_processes(url, jobs, args) as clients:
            reset_memory(args)
            before = loop_counters(scheduler)
            seconds, client_cpu = run_clients(clients, jobs)
            label = f"server over HTTP, {args.concurrency} streams from {len(clients)} client processes"
            row = stage_row(HTTP, label, jobs, seconds, "closed loop", args) | loop_split(scheduler, before)
    finally:
        scheduler.close()  # stopping the server closes it too, unless the server never started
    log(row)
    return dict(row, client_cpu_share=client_cpu)


# -- static batching ----------------------------------------------------------------------------------


def batches(jobs: list[Job], size: int, by_length: bool) -> list[list[Job]]:
    ordered = sorted(jobs, key=lambda j: j.output) if by_length else jobs
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def left_padded(batch: list[Job], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(j.prompt) for j in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, job in enumerate(batch):
        ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt)
        mask[row, width - len(job.prompt) :] = 1
    return ids.to(device), mask.to(device)


def timed_generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, args) -> tuple[torch.Tensor, float]:
    synchronize(args)
    start = time.perf_counter()
    out = generate(model, ids, mask, max_new_tokens=new_tokens, eos_token_id=[])
    synchronize(args)
    return out, time.perf_counter() - start


def warm_static(model, plans: list[list[list[Job]]], args) -> None:
    """Every batch of every order once, untimed, as the timed run calls it: its prefill shape (Triton
    compiles and tunes per shape) and its decoding bucket (a CUDA graph per bucket)."""
    engine_for(model).reserve(args.concurrency, args.prompt_max + args.output_max)
    for plan in plans:
        for batch in plan:
            ids, mask = left_padded(batch, args.device)
            for new_tokens in (1, 2):
                generate(model, ids, mask, max_new_tokens=new_tokens, eos_token_id=[])
    synchronize(args)


def static_stage(model, kind: str, plan: list[list[Job]], args) -> dict:
    """The batches of ``plan`` timed: each one's prefill (a call of one new token), then its whole call."""
    reset_memory(args)
    prefill = whole = 0.0
    padded = 0
    for batch in plan:
        ids, mask = left_padded(batch, args.device)
        longest = max(j.output for j in batch)
        prefill += timed_generate(model, ids, mask, 1, args)[1]
        out, seconds = timed_generate(model, ids, mask, longest, args)
        whole += seconds
        padded += longest * len(batch)
        for job, tokens in zip(batch, out[:, ids.shape[1] :].tolist()):
            job.tokens = tokens[: job.output]
            job.counted = len(job.tokens)
    jobs = [j for batch in plan for j in batch]
    row = stage_row(kind, f"{NAMES[kind]}, batches of {args.concurrency}", jobs, whole, "-", args)
    prompt_tokens = sum(len(j.prompt) for j in jobs)
    decoded = row["output_tokens"] - len(jobs)  # the first token of each comes with its prefill
    row |= dict(
        padded_tokens_per_s=padded / whole,
        prompt_tokens=prompt_tokens,
        prefill_seconds=prefill,
        prefill_tokens_per_s=prompt_tokens / prefill,
        decode_seconds=whole - prefill,
        decode_tokens_per_s=decoded / (whole - prefill) if whole > prefill else float("nan"),
    )
    log(row)
    return row


def static_stages(model, jobs: dict[str, list[Job]], args) -> list[dict]:
    """Static batching of ``jobs[ARRIVAL]`` in arrival order, then of ``jobs[SORTED]`` (the same
    requests) sorted by output length, from a released engine warmed on every batch of both."""
    plans = {ARRIVAL: batches(jobs[ARRIVAL], args.concurrency, False), SORTED: batches(jobs[SORTED], args.concurrency, True)}
    release(model)
    gc.collect()
    warm_static(model, list(plans.values()), args)
    rows = [static_stage(model, kind, plan, args) for kind, plan in plans.items()]
    release(model)  # the server's stages run without static batching's state pool
    gc.collect()
    return rows


# -- the profile stage --------------------------------------------------------------------------------


class ProfiledScheduler(Scheduler):
    """The scheduler with Python's profiler over its thread and torch's over its loop's iterations
    ``window`` (``(skipped, recorded)``; set it before ``start``). Both profilers see only the thread
    that starts them, so they start in the scheduler's own thread."""

    window = (100, 50)

    def _run(self) -> None:
        self.torch_ops, self.torch_error = None, None
        self.python_profile = cProfile.Profile()
        with contextlib.ExitStack() as stack:
            self.torch_profile = self._start_torch_profile(stack)
            self.python_profile.enable()
            try:
                super()._run()
            finally:
                self.python_profile.disable()

    def _start_torch_profile(self, stack: contextlib.ExitStack):
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.engine.device.type == "cuda" else [])
        skipped, recorded = self.window
        plan = schedule(wait=max(skipped - 1, 0), warmup=1, active=recorded, repeat=1)
        try:
            return stack.enter_context(profile(activities=activities, schedule=plan, on_trace_ready=self._keep_ops))
        except Exception as error:  # the loop goes on without it (an exception here would end the thread)
            self.torch_error = f"{type(error).__name__}: {error}"
            return None

    def _iterate(self) -> None:
        super()._iterate()
        if self.torch_profile is None:
            return
        self.python_profile.disable()  # the torch profiler's own work (at its window's end: its events) is not the loop's
        try:
            self.torch_profile.step()
        except Exception as error:  # as above: keep the loop, lose the torch profile
            self.torch_profile, self.torch_error = None, f"{type(error).__name__}: {error}"
        self.python_profile.enable()

    def _keep_ops(self, profiler) -> None:
        self.torch_ops = profiler.key_averages()


def python_top(profile: cProfile.Profile, steps: int, top: int) -> dict:
    """The functions with the most time of their own and the most time in all, per decoding step."""
    stats = pstats.Stats(profile).stats
    rows = [
        dict(
            function=function_name(where), calls=calls, self_ms_per_step=1e3 * own / steps, total_ms_per_step=1e3 * total / steps
        )
        for where, (_, calls, own, total, _) in stats.items()
    ]
    return {
        "by_self_time": sorted(rows, key=lambda r: -r["self_ms_per_step"])[:top],
        "by_total_time": sorted(rows, key=lambda r: -r["total_ms_per_step"])[:top],
    }


def function_name(where: tuple[str, int, str]) -> str:
    path, line, name = where
    if path == "~":  # a built-in
        return name
    short = os.path.relpath(path, ROOT) if path.startswith(ROOT) else "/".join(path.split(os.sep)[-2:])
    return f"{short}:{line}({name})"


def torch_top(ops, steps: int, top: int) -> dict:
    """torch's ops over the recorded iterations with the most host time of their own, and with the most
    device time of their own (kernels), per iteration."""
    if ops is None:
        return {"by_host_time": [], "by_device_time": []}

    def device_us(event) -> float:  # named self_cuda_time_total before torch 2.4
        return next((getattr(event, n) for n in ("self_device_time_total", "self_cuda_time_total") if hasattr(event, n)), 0.0)

    rows = [
        dict(
            op=e.key,
            calls=e.count,
            self_host_ms_per_step=e.self_cpu_time_total / 1e3 / steps,
            host_ms_per_step=e.cpu_time_total / 1e3 / steps,
            self_device_ms_per_step=device_us(e) / 1e3 / steps,
        )
        for e in ops
    ]
    on_device = [r for r in rows if r["self_device_ms_per_step"] > 0]
    return {
        "by_host_time": sorted(rows, key=lambda r: -r["self_host_ms_per_step"])[:top],
        "by_device_time": sorted(on_device, key=lambda r: -r["self_device_ms_per_step"])[:top],
    }


def profile_stage(model, tokenizer, args, jobs: list[Job]) -> dict:
    """The closed loop under both profilers (slower than unprofiled: compare its phases, not its rate)."""
    scheduler = new_scheduler(model, tokenizer, args, ProfiledScheduler, start=False)
    scheduler.window = args.profile_steps
    scheduler.start()
    before = loop_counters(scheduler)
    try:
        seconds = ClosedLoop(scheduler, jobs, args.concurrency).run()
        split = loop_split(scheduler, before)
    finally:
        scheduler.close()  # ends its thread, and with it both profiles
    row = stage_row(
        "profile", f"server in process under the profilers, {args.concurrency} streams", jobs, seconds, "closed loop", args
    )
    skipped, recorded = args.profile_steps
    return dict(
        row | split,
        python=python_top(scheduler.python_profile, max(split["steps"], 1), args.profile_top),
        torch_window=dict(
            skipped=skipped, recorded=recorded, reached=scheduler.torch_ops is not None, error=scheduler.torch_error
        ),
        torch_ops=torch_top(scheduler.torch_ops, recorded, args.profile_top),
    )


# -- rows and checks ----------------------------------------------------------------------------------


def percentiles(values: list[float], scale: float = 1e3) -> list[float]:
    """p50 and p99 (times ``scale``: milliseconds from seconds), NaN without values."""
    if not values:
        return [float("nan"), float("nan")]
    return [scale * float(v) for v in np.percentile(values, [50, 99])]


def stage_row(kind: str, label: str, jobs: list[Job], seconds: float, rate: str, args) -> dict:
    tokens = sum(j.counted for j in jobs if not j.failed)
    gaps = [b - a for j in jobs for a, b in zip(j.token_times, j.token_times[1:])]
    ttft = [j.token_times[0] - j.submitted for j in jobs if j.token_times]
    tpot = [(j.token_times[-1] - j.token_times[0]) / (len(j.token_times) - 1) for j in jobs if len(j.token_times) > 1]
    itl = percentiles(gaps)
    timed = bool(ttft)  # static batching hands nothing out before its call ends
    return dict(
        kind=kind,
        stage=label,
        rate=rate,
        requests=len(jobs),
        failed=sum(bool(j.failed) for j in jobs),
        output_tokens=tokens,
        expected_tokens=sum(j.output for j in jobs),
        token_events=sum(len(j.token_times) for j in jobs),
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        ttft_ms=percentiles(ttft) if timed else None,
        itl_ms=itl if timed else None,
        itl_p99_over_p50=itl[1] / itl[0] if timed and itl[0] > 0 else None,
        tpot_ms=percentiles(tpot) if timed else None,
        peak_memory_gib=peak_memory(args),
    )


def same_output(reference: list[Job], stages: dict[str, list[Job]], tokenizer) -> dict[str, int]:
    """Per stage, the requests whose tokens (over HTTP: text) differ from ``reference``'s."""
    differing = {}
    for kind, jobs in stages.items():
        if kind == HTTP:
            expected = [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in reference]
            differing[kind] = sum(j.text != text for j, text in zip(jobs, expected))
        else:
            differing[kind] = sum(j.tokens != r.tokens for j, r in zip(jobs, reference))
    return differing


# -- one round ----------------------------------------------------------------------------------------


def run_round(model, tokenizer, args, requests: list[Job], rng: random.Random, first: bool, failures: list[str]):
    """Every stage of ``--stages`` once (the rates stage in the first round only) on fresh copies of
    ``requests``. Returns the rows, and per stage the requests whose output differs from the
    reference's (static batching in arrival order, else the server in process). A stage that fails
    is added to ``failures`` and the others go on (the round keeps what ran)."""
    rates = args.rates if first and "rates" in args.stages else []
    stages = []
    if "static" in args.stages:
        stages.append(
            ("static", {ARRIVAL: fresh(requests), SORTED: fresh(requests)}, lambda jobs: static_stages(model, jobs, args))
        )
    if "server" in args.stages or rates:
        stages.append(
            ("server", {SERVER: fresh(requests)}, lambda jobs: server_stages(model, tokenizer, args, rng, jobs[SERVER], rates))
        )
    if "http" in args.stages:
        stages.append(("http", {HTTP: fresh(requests)}, lambda jobs: [http_stage(model, tokenizer, args, jobs[HTTP])]))
    rows, outputs = [], {}
    for name, jobs, run in stages:
        try:
            rows += run(jobs)
            outputs |= jobs
        except Exception as error:  # a visit's minutes are few: keep the other stages' results
            traceback.print_exc()
            failures.append(f"{name} stage: {type(error).__name__}: {error}")
        gc.collect()
    if "server" not in args.stages:
        outputs.pop(SERVER, None)  # the scheduler ran only the rates stage
    reference = outputs.get(ARRIVAL) or outputs.get(SERVER)
    if reference is None:
        return rows, {}
    return rows, same_output(reference, {k: v for k, v in outputs.items() if v is not reference}, tokenizer)


# -- the record ---------------------------------------------------------------------------------------


def series(rounds: list[list[dict]]) -> dict[str, list[dict]]:
    """Each compared stage's row per round (stages of every round; not the rates stage)."""
    found = {}
    for kind in NAMES:
        rows = [next((r for r in round_rows if r["kind"] == kind), None) for round_rows in rounds]
        if rounds and all(rows):
            found[kind] = rows
    return found


def values(rows: list[dict], key: str, index: int | None = None) -> list[float]:
    picked = [r[key] if index is None else r[key][index] for r in rows]
    return [float("nan") if v is None else v for v in picked]


def static_baseline(s: dict[str, list[dict]]) -> tuple[str, list[float]] | None:
    """The faster static order's tokens/s in each round (or the one static order that ran)."""
    statics = [values(s[k], "tokens_per_s") for k in (ARRIVAL, SORTED) if k in s]
    if not statics:
        return None
    name = BEST_STATIC if len(statics) == 2 else NAMES[ARRIVAL if ARRIVAL in s else SORTED]
    return name, [max(per_round) for per_round in zip(*statics)]


def throughput_measurements(s: dict[str, list[dict]], case: str) -> list[dict]:
    baseline = static_baseline(s)
    found = [
        measurement(case, "output throughput", "tokens/s", "higher", (NAMES[k], values(s[k], "tokens_per_s")), baseline)
        for k in (SERVER, HTTP)
        if k in s
    ]
    if ARRIVAL in s and SORTED in s:
        sides = [(NAMES[k], values(s[k], "tokens_per_s")) for k in (SORTED, ARRIVAL)]
        found.append(measurement(case, "output throughput", "tokens/s", "higher", *sides))
    elif baseline is not None and not found:
        found.append(measurement(case, "output throughput", "tokens/s", "higher", baseline, None))
    return found


def static_split_measurements(s: dict[str, list[dict]], case: str) -> list[dict]:
    found = []
    for k in (ARRIVAL, SORTED):
        if k in s:
            for metric, key in (
                ("prefill throughput (prompt tokens)", "prefill_tokens_per_s"),
                ("decode throughput (prefill and first tokens taken out)", "decode_tokens_per_s"),
            ):
                found.append(measurement(case, metric, "tokens/s", "higher", (NAMES[k], values(s[k], key)), None))
    return found


def server_measurements(s: dict[str, list[dict]], case: str) -> list[dict]:
    """The server's latencies and its loop's time per decoding step by phase, round by round."""
    found = []
    for k in (SERVER, HTTP):
        if k not in s:
            continue
        for key, what in (
            ("ttft_ms", "time to first token"),
            ("itl_ms", "inter-token latency"),
            ("tpot_ms", "time per output token"),
        ):
            for i, q in enumerate(("p50", "p99")):
                found.append(measurement(case, f"{what}, {q}", "ms", "lower", (NAMES[k], values(s[k], key, i)), None))
        ratio = (NAMES[k], values(s[k], "itl_p99_over_p50"))
        found.append(measurement(case, "inter-token latency, p99 / p50", "ratio", "lower", ratio, None))
        for phase in (*PHASES, "total"):
            per_step = (NAMES[k], [r["loop_ms_per_step"][phase] for r in s[k]])
            found.append(measurement(case, f"scheduler loop per decoding step, {phase}", "ms", "lower", per_step, None))
    return found


def measurements(rounds: list[list[dict]], args) -> list[dict]:
    s = series(rounds)
    n = args.concurrency * args.waves
    case = f"{n} requests, {args.concurrency} streams against batches of {args.concurrency}"
    return throughput_measurements(s, case) + static_split_measurements(s, case) + server_measurements(s, case)


def targets(rounds: list[list[dict]]) -> tuple[list[str], dict]:
    """Each server side's tokens/s over the faster static order's and its p99 / p50 inter-token
    latency: the median over rounds of the per-round values, against 0.80 and 3."""
    s = series(rounds)
    baseline = static_baseline(s)
    lines, checks = [], {}
    for k in (SERVER, HTTP):
        if k not in s:
            continue
        spread = values(s[k], "itl_p99_over_p50")
        checks[k] = {"itl_p99_over_p50": {"value": statistics.median(spread), "rounds": spread}}
        if baseline is not None:
            ratios = [ours / theirs for ours, theirs in zip(values(s[k], "tokens_per_s"), baseline[1])]
            checks[k]["throughput_vs_static"] = {"value": statistics.median(ratios), "rounds": ratios}
        for name, check in checks[k].items():
            check["pass"] = check["value"] >= 0.8 if name == "throughput_vs_static" else check["value"] <= 3
        lines += target_lines(NAMES[k], checks[k], baseline[0] if baseline else None)
    return lines, checks


def target_lines(name: str, checks: dict, baseline: str | None) -> list[str]:
    verdict = {True: "PASS", False: "MISS"}
    lines = []
    if "throughput_vs_static" in checks:
        c = checks["throughput_vs_static"]
        lines.append(
            f"- {name}: {c['value']:.2f}x ({min(c['rounds']):.2f}-{max(c['rounds']):.2f}x over {len(c['rounds'])} rounds) "
            f"the tokens/s of {baseline} (target >= 0.80): {verdict[c['pass']]}"
        )
    c = checks["itl_p99_over_p50"]
    lines.append(
        f"- {name}: inter-token latency p99 / p50 = {c['value']:.2f} ({min(c['rounds']):.2f}-{max(c['rounds']):.2f}) "
        f"(target <= 3): {verdict[c['pass']]}"
    )
    return lines


def pair(values_, spec: str = ".1f") -> str:
    return "-" if values_ is None else " / ".join(format(v, spec) for v in values_)


def number(value, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def stage_table(rows: list[dict]) -> list[str]:
    lines = [
        "| round | stage | rate (req/s) | requests | output tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | "
        "p99 / p50 | per-token p50 / p99 ms | peak GPU memory GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tps = number(r["tokens_per_s"]) + (f" ({r['padded_tokens_per_s']:,.0f} padded)" if "padded_tokens_per_s" in r else "")
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['round']} | {r['stage']} | {r['rate']} | {r['requests']}{failed} | {tps} | {pair(r['ttft_ms'])} | "
            f"{pair(r['itl_ms'], '.2f')} | {number(r['itl_p99_over_p50'], '.2f')} | {pair(r['tpot_ms'], '.2f')} | "
            f"{number(r['peak_memory_gib'], '.2f')} |"
        )
    return lines


def static_table(rows: list[dict]) -> list[str]:
    lines = [
        "| round | stage | prefill s | prefill prompt tokens/s | decode s | decode tokens/s | end-to-end tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "prefill_seconds" in r:
            lines.append(
                f"| {r['round']} | {r['stage']} | {r['prefill_seconds']:.3f} | {r['prefill_tokens_per_s']:,.0f} | "
                f"{r['decode_seconds']:.3f} | {r['decode_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} |"
            )
    return lines


def loop_table(rows: list[dict]) -> list[str]:
    lines = [
        "| round | stage | steps | prefill calls | output tokens / step | "
        + " | ".join(f"{p} ms" for p in (*PHASES, "total"))
        + " |",
        "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in range(len(PHASES) + 1)) + " |",
    ]
    for r in rows:
        if "loop_ms_per_step" in r:
            split = " | ".join(f"{r['loop_ms_per_step'][p]:.2f}" for p in (*PHASES, "total"))
            per_step = r["output_tokens"] / max(r["steps"], 1)
            lines.append(f"| {r['round']} | {r['stage']} | {r['steps']} | {r['prefill_calls']} | {per_step:.1f} | {split} |")
    return lines


def python_table(title: str, rows: list[dict]) -> list[str]:
    lines = ["", title, "", "| function | calls | own ms / step | in all ms / step |", "| --- | --- | --- | --- |"]
    return lines + [
        f"| `{r['function']}` | {r['calls']} | {r['self_ms_per_step']:.3f} | {r['total_ms_per_step']:.3f} |" for r in rows
    ]


def torch_table(title: str, rows: list[dict]) -> list[str]:
    if not rows:  # no device ops on the CPU
        return []
    lines = ["", title, "", "| op | calls | host own ms | host in all ms | device own ms |", "| --- | --- | --- | --- | --- |"]
    return lines + [
        f"| `{r['op']}` | {r['calls']} | {r['self_host_ms_per_step']:.3f} | {r['host_ms_per_step']:.3f} | "
        f"{r['self_device_ms_per_step']:.3f} |"
        for r in rows
    ]


def profile_lines(profile: dict | None, shown: int = 12) -> list[str]:
    if not profile:
        return []
    lines = ["## Profile of the server in process", ""]
    lines += [f"- {profile['stage']}: {profile['tokens_per_s']:,.0f} tokens/s under the profilers, {profile['steps']} steps", ""]
    lines += loop_table([dict(profile, round="profile")])
    lines += python_table("Python, by time of its own (ms per decoding step):", profile["python"]["by_self_time"][:shown])
    lines += python_table("Python, by time in all (ms per decoding step):", profile["python"]["by_total_time"][:shown])
    window, ops = profile["torch_window"], profile["torch_ops"]
    where = f"over iterations {window['skipped']} to {window['skipped'] + window['recorded']} (ms per iteration)"
    if not window["reached"]:
        return [*lines, "", f"torch's profiler recorded nothing {where}: {window['error'] or 'the run had fewer iterations'}"]
    lines += torch_table(f"torch ops by host time of their own, {where}:", ops["by_host_time"][:shown])
    return lines + torch_table(f"torch ops by device time of their own, {where}:", ops["by_device_time"][:shown])


@dataclass
class Results:
    """What the run has measured so far."""

    info: dict
    rounds: list[list[dict]] = field(default_factory=list)  # each round's rows
    differing: list[dict] = field(default_factory=list)  # each round's requests whose output differs, per stage
    failures: list[str] = field(default_factory=list)
    profile: dict | None = None

    @property
    def rows(self) -> list[dict]:
        return [row for rows in self.rounds for row in rows]


def report_lines(results: Results, target_text: list[str]) -> list[str]:
    rows = results.rows
    lines = ["# Serving load", "", *(f"- {k}: {v}" for k, v in results.info.items()), "", *stage_table(rows), ""]
    lines += ["## Static batching: prefill and decoding apart", "", *static_table(rows), ""]
    lines += ["## The scheduler's loop per decoding step", "", *loop_table(rows), ""]
    lines += ["## Outputs", ""]
    for r, found in enumerate(results.differing):
        counts = ", ".join(f"{NAMES[k]} {n}" for k, n in found.items()) or "nothing compared"
        lines.append(f"- round {r}: requests whose output differs from the reference's: {counts}")
    short = [r for r in rows if r["output_tokens"] != r["expected_tokens"]]
    lines.append(f"- stages whose output tokens differ from their requests' max_tokens: {len(short)}")
    lines += [f"- FAILED: {failure}" for failure in results.failures]
    return [*lines, "", "## Targets", "", *target_text, "", *profile_lines(results.profile)]


def run_notes(results: Results) -> list[str]:
    info, rows = results.info, results.rows
    open_loop = [
        f"server in process, Poisson arrivals at {r['rate']} requests/s (first round only): {r['tokens_per_s']:,.0f} tokens/s"
        for r in rows
        if r["kind"] == "rates"
    ]
    clients = [f"{max(r['client_cpu_share']):.2f}" for r in rows if r["kind"] == HTTP]
    return [
        f"model {info['model']}, {info['dtype']}, prompts {info['prompt_tokens']} tokens, outputs {info['output_tokens']} "
        f"tokens, greedy, no stop token; prefill chunk {info['prefill_chunk']}, every {info['prefill_every']}; no prefix cache",
        "each round: static batching (arrival order, then sorted by output length; every batch run once untimed first), "
        "then the scheduler in process, then efla serve's app over HTTP on a loopback port with streaming clients in "
        "processes of their own",
        *open_loop,
        *([f"HTTP clients' busiest process's CPU share of its run, per round: {', '.join(clients)}"] if clients else []),
        "requests whose output differs from the reference's (static batching in arrival order), per round: "
        + "; ".join(", ".join(f"{k} {n}" for k, n in found.items()) for found in results.differing),
        *(f"failed: {failure}" for failure in results.failures),
    ]


def write_outputs(args, results: Results) -> None:
    from efla.records import atomic_write, atomic_write_json

    target_text, checks = targets(results.rounds)
    atomic_write(os.path.join(args.out, "serve_load.md"), "\n".join(report_lines(results, target_text)) + "\n")
    record = dict(
        info=results.info,
        rows=results.rows,
        differing_outputs=results.differing,
        failures=results.failures,
        targets=checks,
        profile=results.profile,
    )
    atomic_write_json(os.path.join(args.out, "serve_load.json"), record)
    if results.profile:
        atomic_write_json(os.path.join(args.out, "serve_profile.json"), results.profile)
    found = measurements(results.rounds, args)
    if found:
        title = f"Serving load, {results.info['model']}"
        write_run(
            os.path.join(args.out, "serve_load_run.json"), "serve_load", title, len(results.rounds), found, run_notes(results)
        )


# -- the command --------------------------------------------------------------------------------------


def reset_memory(args) -> None:
    if args.device.startswith("cuda"):
        synchronize(args)
        torch.cuda.reset_peak_memory_stats()


def peak_memory(args) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None


def synchronize(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def log(row: dict) -> None:
    print(f"  {row['stage']} ({row['rate']}): {row['tokens_per_s']:,.0f} tokens/s", flush=True)


def rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def stage_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = sorted(set(names) - set(STAGES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(STAGES)}, got {text!r}")
    return names


def iteration_window(text: str) -> tuple[int, int]:
    try:
        skipped, recorded = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SKIPPED,RECORDED (two integers), got {text!r}") from None
    if skipped < 1 or recorded < 1:
        raise argparse.ArgumentTypeError(f"expected two integers >= 1, got {text!r}")
    return skipped, recorded


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--preset", default="340m-efla", help="a preset with random weights")
    source.add_argument("--model", default=None, help="a saved model directory instead of --preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on the CPU"
    )
    ap.add_argument("--stages", type=stage_list, default=STAGES, help=f"some of {','.join(STAGES)}")
    ap.add_argument("--concurrency", type=int, default=256, help="streams of the server's stages, static batch size")
    ap.add_argument("--waves", type=int, default=2, help="requests of each round's stages = waves x concurrency")
    ap.add_argument("--max-batch", type=int, default=None, help="scheduler slots (default: --concurrency)")
    ap.add_argument("--http-clients", type=int, default=4, help="client processes of the http stage (streams split among them)")
    ap.add_argument("--rates", type=rates, default=rates("64,inf"), help="request rates of the rates stage")
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
    ap.add_argument(
        "--profile-steps",
        type=iteration_window,
        default=(100, 50),
        help="profile stage: torch's profiler skips, then records, this many iterations",
    )
    ap.add_argument("--profile-top", type=int, default=25, help="profile stage: rows of each table")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every stage, taking turns (the rates stage: the first only)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="default: $OUT or the current directory")
    args = ap.parse_args(argv)
    check_args(ap, args)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    chunk, every = prefill_defaults(torch.device(args.device))
    args.prefill_chunk = args.prefill_chunk or chunk
    args.prefill_every = args.prefill_every or every
    return args


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Mistakes in the options, before the model loads."""
    if not 1 <= args.prompt_min <= args.prompt_max or not 1 <= args.output_min <= args.output_max:
        ap.error("expected 1 <= --prompt-min <= --prompt-max and 1 <= --output-min <= --output-max")
    if min(args.concurrency, args.waves, args.rounds, args.http_clients, args.requests) < 1:
        ap.error("expected --concurrency, --waves, --rounds, --http-clients and --requests >= 1")
    missing = [m for m in HTTP_MODULES if importlib.util.find_spec(m) is None]
    if "http" in args.stages and missing:
        ap.error(f"the http stage needs {', '.join(missing)} (pip install 'efla[serve]' httpx), or leave it out of --stages")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    model, tokenizer = load(args)
    rng = random.Random(args.seed)
    requests = make_jobs(args.concurrency * args.waves, model.config.vocab_size, args, rng)
    info = dict(
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        command=" ".join(sys.argv),
        model=args.model or args.preset,
        dtype=args.dtype,
        stages=",".join(args.stages),
        prompt_tokens=[args.prompt_min, args.prompt_max],
        output_tokens=[args.output_min, args.output_max],
        prefill_chunk=args.prefill_chunk,
        prefill_every=args.prefill_every,
        threads=torch.get_num_threads(),
    )
    print(f"{info['model']} on {args.device} ({args.dtype}): stages {info['stages']}, {args.rounds} rounds", flush=True)
    results = Results(info)
    for r in range(args.rounds):
        rows, differing = run_round(model, tokenizer, args, requests, rng, r == 0, results.failures)
        results.rounds.append([dict(row, round=r) for row in rows])
        results.differing.append(differing)
        write_outputs(args, results)  # a run stopped early keeps the rounds it ended
    if "profile" in args.stages:
        try:
            results.profile = profile_stage(model, tokenizer, args, fresh(requests))
        except Exception as error:  # the rounds are written; report the profile's failure with them
            traceback.print_exc()
            results.failures.append(f"profile stage: {type(error).__name__}: {error}")
        write_outputs(args, results)
    with open(os.path.join(args.out, "serve_load.md")) as f:
        print(f.read(), flush=True)
    print("\n".join(["Summary:", *targets(results.rounds)[0], *(f"FAILED: {f}" for f in results.failures)]), flush=True)
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
