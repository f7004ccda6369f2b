"""Streaming clients for the HTTP stage of ``benchmarks/serve_load.py``, run as a process of their own so
that the server's process does none of the clients' work (the server's process is started by
serve_load.py; this one only talks to it).

Reads one JSON line on stdin: ``{"url", "model", "streams", "jobs": [[prompt token ids, max_tokens],
...]}``. Opens its connections with ``streams`` short streamed completions (warm-up), prints ``ready``,
waits for a line on stdin, then keeps ``streams`` streamed greedy ``/v1/completions`` requests in
flight over its jobs (a new one as soon as one ends, in order) and prints one JSON line: ``start`` and
``end`` of the run, the process's CPU seconds over it, and per job its send time, the arrival time of
each server-sent event that carries its text (one per token when every token has text of its own), its
text, the usage's completion tokens and its error (``None``). Times are ``time.monotonic()``, one clock
for every process of the machine.

Usage (by serve_load.py): python benchmarks/serve_client.py < config-line
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque

import httpx


def completion(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: its send time, event times, text, counted tokens and error."""
    result = {"sent": time.monotonic(), "times": [], "text": "", "tokens": None, "error": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    read_event(json.loads(line[len("data: ") :]), result)
    except httpx.HTTPError as error:
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def read_event(chunk: dict, result: dict) -> None:
    if "error" in chunk:
        result["error"] = chunk["error"]["message"]
    elif chunk["choices"]:
        result["times"].append(time.monotonic())
        result["text"] += chunk["choices"][0]["text"]
    if chunk.get("usage"):
        result["tokens"] = chunk["usage"]["completion_tokens"]


async def closed_loop(client: httpx.AsyncClient, config: dict) -> list[dict]:
    """``streams`` requests in flight until every job has been sent; results in the jobs' order."""
    waiting = deque(enumerate(config["jobs"]))
    results: list[dict | None] = [None] * len(waiting)

    async def stream() -> None:
        while waiting:
            index, (prompt, max_tokens) = waiting.popleft()
            results[index] = await stream_one(client, config["url"], completion(config["model"], prompt, max_tokens))

    await asyncio.gather(*(stream() for _ in range(config["streams"])))
    return results


async def main() -> None:
    config = json.loads(sys.stdin.readline())
    streams, (first_prompt, _) = config["streams"], config["jobs"][0]
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        warm = completion(config["model"], first_prompt[:8], 2)
        warmed = await asyncio.gather(*(stream_one(client, config["url"], warm) for _ in range(streams)))
        failed = [r["error"] for r in warmed if r["error"]]
        if failed:
            sys.exit(f"serve_client.py: the warm-up failed: {failed[0]}")
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start, cpu = time.monotonic(), time.process_time()
        results = await closed_loop(client, config)
        end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "cpu_seconds": time.process_time() - cpu, "results": results}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
