"""``capture``: record a function's GPU work as a CUDA graph, for the code paths that replay a step
(the decoding engine's steps and prefills, MAD's graphed training steps).

A graph replays the kernels recorded, on the tensors they read and wrote then: its inputs are
static tensors that the caller fills in place before each replay, its outputs those the recorded
call returned or wrote. Recording itself runs nothing; kernels that compile or tune on their first
call (Triton's) must have run before, which ``warmup`` does on a side stream, as PyTorch advises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["capture"]


def capture(
    run: Callable[[], Any], *, warmup: int = 0, pool=None, stream: torch.cuda.Stream | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` called ``warmup`` times on a side stream, then recorded as a graph (in memory
    ``pool`` when given, shared by graphs that never replay at once; on ``stream`` when given, else
    PyTorch's capture stream). Returns the graph and what the recorded call returned."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out
