"""Nothing a request leaves behind outlives it: after a few hundred mixed requests over HTTP (streamed,
dropped by the client mid-stream, whole with n > 1, completions and chat, with a prefix cache small
enough to be full after the warm-up) the scheduler's per-request tables are empty, every slot is
free, no request or run object is alive, and from one round of requests to the next Python's traced
memory, the bytes of the tensors Python holds (beyond the prefix cache's) and the process's resident
memory each grow by less than a fraction of what one leaked request would hold, per request (the
first two see Python objects and tensors; the last also what native code keeps)."""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc

import torch

from efla.serving import PrefixCache, prefix_cache
from efla.serving.requests import Request
from efla.serving.runs import Run

from .conftest import MODEL_NAME, http_stack, serve

http_stack()
import httpx  # noqa: E402

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}<s>assistant:"
SYSTEM = "You write short Python functions with docstrings. " * 3
WARM_UP, MEASURED = 160, 160
BYTES_PER_REQUEST = 512  # a leaked request (its prompt, tokens, text and events) holds several KiB
# A leaked state row of this model is about 20 KiB; once warm, the process's resident memory grows by
# about 5 KiB per request over the next 320 requests (glibc's heaps and Python's caches settling)
NATIVE_BYTES_PER_REQUEST = 12 << 10


def request_body(i: int, rng: random.Random) -> tuple[str, dict, int | None]:
    """The ``i``-th request of the mix: route, body and, for a stream the client drops, after how many chunks."""
    words = " ".join(rng.choice(("def", "self", "return", "x", "cache")) for _ in range(rng.randint(2, 24)))
    prefix = SYSTEM if i % 2 else ""
    common = {"model": MODEL_NAME, "max_tokens": rng.randint(2, 12), "temperature": 0.7 if i % 3 == 0 else 0.0}
    if i % 5 == 0:
        common["stop"] = [" return"]
    kind = i % 6
    if kind < 3:
        body = {**common, "prompt": prefix + words, "stream": kind < 2, "n": 1 if kind < 2 else 2}
        if kind == 0:
            body["logprobs"] = 1
        return "/v1/completions", body, (1 if kind == 1 else None)
    messages = [{"role": "system", "content": prefix}] if prefix else []
    body = {**common, "messages": [*messages, {"role": "user", "content": words}], "stream": kind < 5}
    if kind == 5:
        body["n"] = 2
    return "/v1/chat/completions", body, (1 if kind == 4 else None)


async def send_all(url: str, numbers: range, concurrency: int = 8) -> None:
    rng, pending = random.Random(numbers.start), iter(numbers)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def worker() -> None:
            for i in pending:
                route, body, drop_after = request_body(i, rng)
                if not body["stream"]:
                    (await client.post(route, json=body)).raise_for_status()
                    continue
                async with client.stream("POST", route, json=body) as response:
                    response.raise_for_status()
                    chunks = 0
                    async for line in response.aiter_lines():
                        chunks += line.startswith("data:")
                        if drop_after is not None and chunks >= drop_after:
                            break  # the connection closes: the server cancels the request

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def live(kind: type) -> int:
    return sum(isinstance(o, kind) for o in gc.get_objects())


# A type check, not isinstance, leaves alone the deprecated module proxies the collector also lists.
_REAL_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def tensor_bytes() -> int:
    """Bytes of the distinct storages of the tensors Python holds."""
    storages = {}
    for o in gc.get_objects():
        if type(o) not in _REAL_TENSOR_TYPES or o.device.type == "meta":
            continue
        try:
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # traced tensors that other tests' torch.compile left behind own no memory
            continue
    return sum(storages.values())


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10


def settle(served) -> None:
    status = served.wait_idle(timeout=60)
    assert status["slots_free"] == status["slots_total"] and status["waiting"] == 0 and status["decoding"] == 0, status
    gc.collect()


def test_requests_leave_nothing_behind(loaded, monkeypatch):
    # the prefix cache fills up to its bounds during the warm-up, so what grows after it is a leak
    monkeypatch.setattr(prefix_cache, "_SEEN_BLOCKS", 32)
    cache = PrefixCache(block=16, max_bytes=256 << 10)
    with serve(*loaded, chat_template=TEMPLATE, prefix_cache=cache, max_batch=8, prefill_chunk=64) as served:
        scheduler = served.scheduler
        asyncio.run(send_all(served.url, range(WARM_UP)))
        settle(served)
        # first a round without tracemalloc (its traces take memory of their own) for resident memory
        resident = resident_bytes()
        asyncio.run(send_all(served.url, range(WARM_UP, WARM_UP + 2 * MEASURED)))
        settle(served)
        resident_growth = resident_bytes() - resident
        tensors = tensor_bytes() - cache.bytes  # outside tracemalloc's window: reading them allocates
        tracemalloc.start(1)
        try:  # two rounds: the first may still make what lasts (a shape's first use); the second must not
            snapshots = []
            for start in (WARM_UP + 2 * MEASURED, WARM_UP + 3 * MEASURED):
                asyncio.run(send_all(served.url, range(start, start + MEASURED)))
                settle(served)
                snapshots.append(tracemalloc.take_snapshot())
            growth = sum(s.size_diff for s in snapshots[1].compare_to(snapshots[0], "filename"))
        finally:
            tracemalloc.stop()
        tensor_growth = tensor_bytes() - cache.bytes - tensors
        tables = [scheduler._waiting, scheduler._prefilling, scheduler._forked, scheduler._rows]
        assert [len(t) for t in tables] == [0, 0, 0, 0]
        assert sorted(scheduler._free_slots) == list(range(scheduler.max_batch)) and scheduler._holding == 0
        assert scheduler._pending is None and scheduler._joined is None
        assert scheduler.cancelled > 0 and scheduler.served > 4 * MEASURED  # the mix ran: dropped streams, n > 1
        assert live(Request) == 0 and live(Run) == 0
        assert cache.bytes <= cache.max_bytes and cache.evictions > 0
        assert growth < BYTES_PER_REQUEST * MEASURED, f"{growth / MEASURED:.0f} bytes per request stay allocated"
        assert tensor_growth < BYTES_PER_REQUEST * 2 * MEASURED, f"{tensor_growth / (2 * MEASURED):.0f} tensor bytes per request"
        assert resident_growth < NATIVE_BYTES_PER_REQUEST * 2 * MEASURED, (
            f"{resident_growth / (2 * MEASURED):.0f} bytes per request"
        )
