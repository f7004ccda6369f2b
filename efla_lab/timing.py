"""Small CPU timings of the ops (used by ``efla demo``; the full benchmark is benchmarks/cpu_ops.py)."""

from __future__ import annotations

import statistics
import time

import torch

from efla.ops import chunk_efla, recurrent_efla


def _time_once(fn, inputs, backward: bool) -> float:
    for x in inputs:
        x.grad = None
    t0 = time.perf_counter()
    o, _ = fn(*inputs)
    if backward:
        o.float().pow(2).mean().backward()
    return time.perf_counter() - t0


def op_timings(shapes=((1, 512, 4, 64), (1, 2048, 4, 64)), reps: int = 3, seed: int = 0) -> list[dict]:
    """Median wall time of ``chunk_efla`` vs ``recurrent_efla`` (float32, fwd and fwd+bwd)."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for B, T, H, D in shapes:
        q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
        k = torch.randn(B, T, H, D, generator=gen)
        v = torch.randn(B, T, H, D, generator=gen)
        beta = torch.rand(B, T, H, generator=gen)
        inputs = [x.requires_grad_() for x in (q, k, v, beta)]
        row = dict(shape=[B, T, H, D])
        for name, fn in (("chunk", chunk_efla), ("recurrent", recurrent_efla)):
            for backward in (False, True):
                _time_once(fn, inputs, backward)  # warm-up
                ts = [_time_once(fn, inputs, backward) for _ in range(reps)]
                row[f"{name}_{'fwd_bwd' if backward else 'fwd'}_ms"] = 1e3 * statistics.median(ts)
        rows.append(row)
    return rows
