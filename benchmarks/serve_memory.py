"""Serving memory: resident memory of an ``efla serve`` process (the app in this process, uvicorn in a
thread on a free port of 127.0.0.1) over many mixed requests, to show it levels off (no per-request
leak).

The model is a preset's random weights (float32, CPU) with a byte-level BPE tokenizer trained on this
repository's sources. Requests cycle through a fixed mix, ``--concurrency`` in flight at a time:
completions and chat, streamed to the end, streamed and dropped by the client after a few chunks
(the server cancels them), whole (non-streamed) with ``n`` of 1 or 3, prompts sharing a system
prompt (prefix-cache hits) and prompts of their own (misses), some with stop strings, seeds,
logprobs or penalties. Resident memory (``VmRSS`` of ``/proc/self/status``) is read after a
``gc.collect()`` at the end of every ``--every`` requests; the acceptance is that every reading after
the first stays within ``--tolerance`` (5%) of the first. After the run, the scheduler's tables must
be back to their idle size (every slot free, nothing waiting, prefilling or decoding).

``--trim``: after each reading, also the RSS once glibc's ``malloc_trim(0)`` returned the free pages
of its heaps (later readings then start from the trimmed heap).

``--tracemalloc``: also snapshot Python's allocations at each reading and print the lines that grew
most since the first (to find what a leak holds).

Usage: python benchmarks/serve_memory.py [--requests 10000] [--every 1000] [--prefix-cache-mb 0,64]
           [--max-batch 16] [--concurrency 24] [--out benchmarks/results/serve/serve_memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pathlib
import random
import socket
import sys
import threading
import time
import tracemalloc

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from evidence import measurement, write_run  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
SYSTEM = "You are a careful assistant who writes short Python functions with docstrings and tests. " * 3
MODEL = "tiny"


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def release_free_heap() -> float:
    """RSS (MB) after glibc's ``malloc_trim(0)`` hands the free pages of its heaps back (a diagnostic:
    memory that comes back here was free, not leaked)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_mb()


def tiny_model(preset: str):
    """A preset's random weights (float32) and a BPE tokenizer of 320 tokens trained on this repository."""
    from efla.data.tokenizer import train_bpe_tokenizer
    from efla.models import EFLAForCausalLM, get_preset_config

    text = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "efla").rglob("*.py")))[:20_000]
    tokenizer = train_bpe_tokenizer([text], vocab_size=320)
    config = get_preset_config(preset)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    return EFLAForCausalLM(config).eval(), tokenizer


def request_mix(i: int, rng: random.Random) -> tuple[str, dict, int | None]:
    """The ``i``-th request: its route, its body and, for a stream the client drops, after how many chunks."""
    words = " ".join(
        rng.choice(("def", "self", "return", "tensor", "state", "x", "y", "cache")) for _ in range(rng.randint(2, 40))
    )
    shared = i % 2 == 0  # half the prompts start with the same system prompt
    kind = i % 8
    common = {"model": MODEL, "max_tokens": rng.randint(4, 24), "temperature": (0.0, 0.8)[i % 3 == 0]}
    if i % 5 == 0:
        common["seed"] = i
    if i % 7 == 0:
        common["stop"] = [" return"]
    if i % 11 == 0:
        common["presence_penalty"] = 0.5
    if kind in (0, 1, 2, 3):
        body = {**common, "prompt": (SYSTEM if shared else "") + words, "stream": kind < 3}
        if kind == 3:
            body["n"] = 3
        if kind == 1:
            body["logprobs"] = 2
        return "/v1/completions", body, (2 if kind == 2 else None)
    messages = ([{"role": "system", "content": SYSTEM}] if shared else []) + [{"role": "user", "content": words}]
    body = {**common, "messages": messages, "stream": kind < 7}
    if kind == 7:
        body["n"] = 2
    if kind == 4:
        body["logprobs"], body["top_logprobs"] = True, 2
    return "/v1/chat/completions", body, (1 if kind == 6 else None)


async def send(client, i: int, rng: random.Random) -> None:
    route, body, drop_after = request_mix(i, rng)
    if not body["stream"]:
        response = await client.post(route, json=body)
        response.raise_for_status()
        return
    async with client.stream("POST", route, json=body) as response:
        response.raise_for_status()
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data:")
            if drop_after is not None and chunks >= drop_after:
                return  # leaving the block closes the connection: the server cancels the request


async def drive(url: str, start: int, count: int, concurrency: int, seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    numbers = iter(range(start, start + count))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for i in numbers:
                await send(client, i, rng)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


class Server:
    """``efla.serving``'s app for ``scheduler`` under uvicorn in a thread, on a free port."""

    def __init__(self, scheduler, tokenizer):
        import uvicorn

        from efla.serving import create_app

        app = create_app(scheduler, tokenizer, model_name=MODEL, chat_template=CHAT_TEMPLATE)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def idle_tables(scheduler) -> dict:
    """What the scheduler holds per request; all zero when nothing is in flight."""
    return {
        "waiting": len(scheduler._waiting),
        "holding": scheduler._holding,
        "busy_slots": scheduler.max_batch - len(scheduler._free_slots),
        "prefilling": len(scheduler._prefilling),
        "forked": len(scheduler._forked),
        "decoding": len(scheduler._rows),
    }


def wait_idle(scheduler, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while any((tables := idle_tables(scheduler)).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return tables


def top_growth(first, snapshot, lines: int = 8) -> list[str]:
    stats = snapshot.compare_to(first, "lineno")
    return [f"  {s.size_diff / 1024:+.0f} KiB {s.count_diff:+d} blocks {s.traceback}" for s in stats[:lines]]


def run_server(model, tokenizer, cache_mb: int, args) -> list[float]:
    """RSS (MB) after each ``--every`` requests through a fresh server with a prefix cache of ``cache_mb``."""
    from efla.serving import PrefixCache, Scheduler

    cache = PrefixCache(block=args.prefix_block, max_bytes=cache_mb << 20) if cache_mb else None
    scheduler = Scheduler(
        model,
        tokenizer,
        max_batch=args.max_batch,
        max_queue=256,
        max_context=512,
        prefix_cache=cache,
        stop_tokens=[tokenizer.eos_token_id],
        pad_token=tokenizer.pad_token_id,
        seed=0,
    )
    readings, first_snapshot = [], None
    with Server(scheduler, tokenizer) as server:
        for start in range(0, args.requests, args.every):
            began = time.perf_counter()
            asyncio.run(drive(server.url, start, args.every, args.concurrency, seed=start))
            tables = wait_idle(scheduler)
            gc.collect()
            readings.append(resident_mb())
            trimmed = f", {release_free_heap():.1f} MB once glibc returned its free pages" if args.trim else ""
            cache_entries = scheduler.prefix_cache.stats()["entries"] if scheduler.prefix_cache else 0
            print(
                f"prefix cache {cache_mb} MB: {start + args.every} requests, RSS {readings[-1]:.1f} MB{trimmed} "
                f"({time.perf_counter() - began:.1f} s; cache entries {cache_entries}; tables {tables})",
                flush=True,
            )
            if any(tables.values()):
                raise SystemExit(f"the scheduler's tables are not back to idle: {tables}")
            if args.tracemalloc:
                snapshot = tracemalloc.take_snapshot()
                if first_snapshot is None:
                    first_snapshot = snapshot
                else:
                    print("\n".join(top_growth(first_snapshot, snapshot)), flush=True)
    return readings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--every", type=int, default=1_000, help="read RSS after each this many requests")
    p.add_argument("--prefix-cache-mb", default="0,64", help="comma-separated; 0: no prefix cache (default: %(default)s)")
    p.add_argument("--prefix-block", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed growth over the first reading (default: 5%%)")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--trim", action="store_true", help="after each reading, also read RSS after glibc's malloc_trim(0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the run here (benchmarks/evidence.py's shape)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tracemalloc:
        tracemalloc.start(4)
    model, tokenizer = tiny_model(args.preset)
    measurements, notes, passed = [], [], True
    for cache_mb in (int(x) for x in args.prefix_cache_mb.split(",")):
        readings = run_server(model, tokenizer, cache_mb, args)
        growth = max(readings) / readings[0] - 1
        passed &= growth <= args.tolerance
        verdict = "PASS" if growth <= args.tolerance else "MISS"
        line = (
            f"prefix cache {cache_mb} MB: RSS {readings[0]:.1f} -> {readings[-1]:.1f} MB, "
            f"at most {growth:+.1%} over the first reading ({verdict})"
        )
        print(line, flush=True)
        notes.append(line)
        for k, mb in enumerate(readings, 1):
            case = f"prefix cache {cache_mb} MB, after {k * args.every} requests"
            measurements.append(measurement(case, "resident memory", "MB", "lower", ("efla serve", [mb]), None))
    if args.out:
        notes.append(
            f"{args.preset}, float32, CPU; max_batch {args.max_batch}, {args.concurrency} requests in flight over HTTP "
            f"(uvicorn in a thread, httpx client in this process); RSS of the whole process after gc.collect()"
        )
        write_run(args.out, "serve_memory", "Resident memory of efla serve over many mixed requests", 1, measurements, notes)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
