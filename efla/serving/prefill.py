"""One prefill call of the scheduler: which pieces of the waiting prompts it runs, and running them.

A model without softmax-attention layers prefills one piece per prompt as the right-padded rows of
one of the engine's prefill buckets (``DecodeEngine.prefill_rows``: one CUDA graph per shape on the
GPU), each row continuing its slot's state. A hybrid model's pieces run packed and eagerly: the
prompts starting at their first token together, the others one by one (its attention layers take
no packed continuation).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from efla.generation import DecodeEngine
from efla.models.cache import EFLACache

from .requests import Request
from .states import rows_cache

__all__ = ["ROW_TOKENS", "Piece", "plan_rows", "run_rows", "plan_rounds", "run_round", "to_device"]

# The most tokens of one prompt in one prefill call: a long prompt leaves room for others beside it,
# and a GPU's prefill graphs cover rows up to this length.
ROW_TOKENS = 256


@dataclass(eq=False)
class Piece:
    request: Request
    start: int
    end: int

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt[self.start : self.end]

    @property
    def completes(self) -> bool:
        return self.end == len(self.request.prompt)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``; on CUDA through pinned memory, without waiting for the device (the
    pinned block is not reused before the copy ran)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def plan_rows(prefilling: list[Request], engine: DecodeEngine, budget: int) -> list[Piece]:
    """One piece per prompt, first come first served: up to ``ROW_TOKENS`` tokens each, cut at the
    next save point, as many as fit in ``budget`` tokens once padded (rows times the longest piece,
    as the engine's bucket rounds them)."""
    pieces, longest = [], 0
    for request in prefilling:
        start = request.prefilled
        end = min(len(request.prompt), start + min(ROW_TOKENS, budget), *(p for p in request.save_points if p > start))
        rows, length = engine.prefill_shape(len(pieces) + 1, max(longest, end - start))
        if pieces and rows * length > budget:
            break
        pieces.append(Piece(request, start, end))
        longest = max(longest, end - start)
    return pieces


def run_rows(engine: DecodeEngine, pieces: list[Piece]) -> list[torch.Tensor | None]:
    """Prefill ``pieces`` as the rows of one engine prefill bucket; each piece's last-token logits
    where it completes its prompt, else ``None``."""
    logits = engine.prefill_rows([p.tokens for p in pieces], [p.request.slot for p in pieces], [p.start == 0 for p in pieces])
    return [row if p.completes else None for p, row in zip(pieces, logits)]


def plan_rounds(prefilling: list[Request], budget: int) -> list[list[Piece]]:
    """A hybrid model's prefill: up to ``budget`` tokens, first come first served, each request's
    share cut at its save points (pieces of one request go to successive rounds)."""
    rounds: list[list[Piece]] = []
    for request in prefilling:
        if budget == 0:
            break
        start = request.prefilled
        end = min(len(request.prompt), start + budget)
        budget -= end - start
        bounds = [p for p in request.save_points if start < p < end] + [end]
        for i, stop in enumerate(bounds):
            if i == len(rounds):
                rounds.append([])
            rounds[i].append(Piece(request, start, stop))
            start = stop
    return rounds


def run_round(engine: DecodeEngine, pieces: list[Piece]) -> list[torch.Tensor | None]:
    """Prefill a hybrid model's ``pieces`` (at most one per request) into their slots; each piece's
    last-token logits where it completes its prompt, else ``None``. Prompts starting at their first
    token run as ``generate`` prefills them (packed, no initial state); the others continue from
    their slots' states one by one."""
    fresh = [p for p in pieces if p.start == 0]
    groups = [(fresh, EFLACache(len(engine.cache.states)))] if fresh else []
    for piece in (p for p in pieces if p.start > 0):
        slots = to_device([piece.request.slot], torch.long, engine.device)
        groups.append(([piece], rows_cache(engine.cache, slots, [piece.start])))
    logits = {}
    for group, cache in groups:
        logits.update(zip(group, _run_packed(engine, group, cache)))
    return [logits[p] for p in pieces]


def _run_packed(engine: DecodeEngine, pieces: list[Piece], cache: EFLACache) -> list[torch.Tensor | None]:
    def device_long(values):
        return to_device(values, torch.long, engine.device)

    ends = list(itertools.accumulate(p.end - p.start for p in pieces))
    ids = device_long(list(itertools.chain.from_iterable(p.tokens for p in pieces)))
    cu_seqlens = device_long([0, *ends]) if len(pieces) > 1 else None
    out = engine.decoder(input_ids=ids[None], cu_seqlens=cu_seqlens, past_key_values=cache, use_cache=True)
    engine.cache.write_slots(device_long([p.request.slot for p in pieces]), cache)
    complete = [i for i, p in enumerate(pieces) if p.completes]
    if not complete:
        return [None] * len(pieces)
    last = out.last_hidden_state[0, device_long([ends[i] - 1 for i in complete])]
    rows = dict(zip(complete, engine.head(last).float()))
    return [rows.get(i) for i in range(len(pieces))]
