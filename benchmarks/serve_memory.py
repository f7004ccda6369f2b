"""Serving memory: resident memory of an ``efla serve`` process over many mixed requests, to show it
levels off (no per-request leak).

The server is ``python -m efla serve`` in a process of its own, with its default settings unless an
option below overrides one, on a saved model: a preset's random weights (float32, CPU) with a
byte-level BPE tokenizer trained on this repository's sources (in a temporary directory). This
process is the HTTP client only, so the figures are the server's alone.

Requests cycle through a fixed mix, ``--concurrency`` in flight at a time: completions and chat,
streamed to the end, streamed and dropped by the client after a few chunks (the server cancels
them), whole (non-streamed) with ``n`` of 1 or 3, prompts sharing a system prompt (prefix-cache
hits) and prompts of their own (misses), some with stop strings, seeds, logprobs or penalties.
At the end of every ``--every`` requests, once ``/health`` reports every slot free and nothing
waiting, the server's resident memory (``VmRSS`` of ``/proc/<pid>/status``) is read, with the bytes
its prefix cache holds (``/health``). The acceptance is that every reading after the first stays
within ``--tolerance`` (5%) of the first. The prefix cache keeps the states of recent prompts up to
``--prefix-cache-mb`` (the server's default: 1,024 MB), which a run of unique prompts fills by
design; the readings less the bytes it counts (each entry's state, tokens, key and the objects around
them) are the rest of the server, with the index of recently seen block prefixes the cache keeps to
find shared ones (about 9 MB once it holds its 65,536 digests), which is not counted.

Usage: python benchmarks/serve_memory.py [--requests 10000] [--every 1000] [--prefix-cache-mb default,0,4]
           [--serve-args '--max-batch 16'] [--concurrency 80] [--out benchmarks/results/serve/serve_memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time

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
MB = 1 << 20


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def save_tiny_model(preset: str, path: pathlib.Path) -> None:
    """A preset's random weights (float32) and a BPE tokenizer of 320 tokens trained on this repository."""
    from efla.data.tokenizer import train_bpe_tokenizer
    from efla.models import EFLAForCausalLM, get_preset_config

    text = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "efla").rglob("*.py")))[:20_000]
    tokenizer = train_bpe_tokenizer([text], vocab_size=320)
    config = get_preset_config(preset)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    EFLAForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "chat.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


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


async def send(client, i: int, rng: random.Random) -> int:
    """Sends request ``i``; returns 1 if it was sent again, once, because the server closed its pooled
    connection before answering (a keep-alive connection closing as the request went out), else 0."""
    import httpx

    route, body, drop_after = request_mix(i, rng)
    for attempt in (0, 1):
        try:
            await send_once(client, route, body, drop_after)
            return attempt
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if attempt:
                raise
    return 1


async def send_once(client, route: str, body: dict, drop_after: int | None) -> None:
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


async def drive(url: str, start: int, count: int, concurrency: int, seed: int) -> int:
    """Sends requests ``start .. start + count - 1``, ``concurrency`` at a time; returns how many were sent again."""
    import httpx

    rng = random.Random(seed)
    numbers = iter(range(start, start + count))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> int:
            return sum([await send(client, i, rng) for i in numbers])

        return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))


class Server:
    """``python -m efla serve model_dir *options`` on a free port of 127.0.0.1, its stderr in ``log``."""

    def __init__(self, model_dir: pathlib.Path, options: list[str], log: pathlib.Path):
        self.command = [sys.executable, "-m", "efla", "serve", str(model_dir), "--port", "0", "--served-model-name", MODEL]
        self.command += ["--chat-template", str(model_dir / "chat.jinja"), "--log-level", "warning", *options]
        self.log_path = log

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        deadline = time.monotonic() + 300
        while (found := re.search(r"at (http://[\d.]+:\d+)/v1", self.log_path.read_text())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"efla serve did not start:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        self.url = found.group(1)
        while self.health() is None:  # the socket listens before the app answers
            time.sleep(0.1)
        return self

    def health(self) -> dict | None:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=10).json()
        except httpx.TransportError:
            return None

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """``/health`` once every slot is free and nothing waits (or at ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            idle = status["slots_free"] == status["slots_total"] and status["waiting"] == 0 and status["decoding"] == 0
            if idle or time.monotonic() > deadline:
                return status
            time.sleep(0.05)

    def __exit__(self, kind, error, traceback):
        if error is not None:
            state = "running" if self.process.poll() is None else f"exited with status {self.process.returncode}"
            print(f"efla serve ({state}) logged:\n{self.log_path.read_text()[-4000:]}", file=sys.stderr, flush=True)
        self.process.terminate()  # SIGTERM: the server drains (nothing is in flight) and exits
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def server_options(cache: str, args) -> list[str]:
    """``efla serve``'s options for one run: only those this benchmark was asked to override."""
    options = [] if cache == "default" else ["--prefix-cache-mb", cache]
    return options + shlex.split(args.serve_args)


def run_server(model_dir: pathlib.Path, cache: str, args) -> tuple[list[tuple[float, float]], int]:
    """(RSS, prefix-cache bytes) in MB after each ``--every`` requests through a fresh server, and how
    many requests were sent again."""
    readings, resent = [], 0
    with Server(model_dir, server_options(cache, args), model_dir.parent / f"serve_{cache}.log") as server:
        for start in range(0, args.requests, args.every):
            began = time.perf_counter()
            resent += asyncio.run(drive(server.url, start, args.every, args.concurrency, seed=start))
            status = server.wait_idle()
            if status["slots_free"] != status["slots_total"] or status["waiting"] or status["decoding"]:
                raise SystemExit(f"the server is not back to idle: {status}")
            prefix = status["prefix_cache"]
            readings.append((resident_mb(server.process.pid), prefix.get("bytes", 0) / MB))
            print(
                f"prefix cache {cache}: {start + args.every} requests, server RSS {readings[-1][0]:.1f} MB "
                f"(prefix cache {readings[-1][1]:.1f} MB in {prefix.get('entries', 0)} entries; "
                f"{time.perf_counter() - began:.1f} s)",
                flush=True,
            )
    return readings, resent


def growth_line(cache: str, readings: list[tuple[float, float]], tolerance: float) -> tuple[str, bool]:
    rss = [r for r, _ in readings]
    rest = [r - c for r, c in readings]
    growth, rest_growth = max(rss) / rss[0] - 1, max(rest) / rest[0] - 1
    verdict = "PASS" if growth <= tolerance else "MISS"
    line = (
        f"prefix cache {cache}: server RSS {rss[0]:.1f} -> {rss[-1]:.1f} MB, at most {growth:+.1%} over the first "
        f"reading ({verdict})"
    )
    if readings[-1][1]:
        line += (
            f"; the prefix cache holds {readings[0][1]:.1f} -> {readings[-1][1]:.1f} MB of it; less those, "
            f"{rest[0]:.1f} -> {rest[-1]:.1f} MB, at most {rest_growth:+.1%}"
        )
    return line, growth <= tolerance


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--every", type=int, default=1_000, help="read RSS after each this many requests")
    p.add_argument(
        "--prefix-cache-mb",
        default="default,0,4",
        help="comma-separated, one server each; default: efla serve's own (1024), 0: no prefix cache (default: %(default)s)",
    )
    p.add_argument("--serve-args", default="", help="more options of efla serve for every server, e.g. '--max-batch 16'")
    p.add_argument("--concurrency", type=int, default=80, help="requests in flight (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed growth over the first reading (default: 5%%)")
    p.add_argument("--out", default=None, help="write the run here (benchmarks/evidence.py's shape)")
    args = p.parse_args(argv)
    measurements, notes, passed = [], [], True
    with tempfile.TemporaryDirectory(prefix="efla-serve-memory-") as tmp:
        model_dir = pathlib.Path(tmp) / MODEL
        save_tiny_model(args.preset, model_dir)
        for cache in args.prefix_cache_mb.split(","):
            readings, resent = run_server(model_dir, cache, args)
            line, ok = growth_line(cache, readings, args.tolerance)
            line += f"; {resent} requests sent again after the server closed their pooled connection" if resent else ""
            passed &= ok
            print(line, flush=True)
            notes.append(line)
            for k, (rss, cached) in enumerate(readings, 1):
                case = f"prefix cache {cache}, after {k * args.every} requests"
                measurements.append(measurement(case, "server resident memory", "MB", "lower", ("efla serve", [rss]), None))
                measurements.append(measurement(case, "prefix cache", "MB", "lower", ("efla serve", [cached]), None))
    if args.out:
        notes.append(
            f"{args.preset}, float32, CPU; python -m efla serve in its own process, its defaults but "
            f"--prefix-cache-mb where not 'default' (1024) and {args.serve_args or 'no other option'}; "
            f"{args.concurrency} requests in flight over HTTP from the benchmark's process; RSS of the server "
            f"process (/proc/<pid>/status) once idle"
        )
        write_run(args.out, "serve_memory", "Resident memory of efla serve over many mixed requests", 1, measurements, notes)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
