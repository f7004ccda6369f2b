"""Choosing the next token on the device, per row, without reading anything back to the host.

Each row has its own temperature (``0``: greedy), top-k (``0``: off) and top-p (``1``: off), held
in tensors, so one captured decoding step serves a batch that mixes them. The filters are
transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``, in that
order and with the same arithmetic (one sort serves both). A token is drawn by the exponential
race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token is a draw from ``p``, and the noise comes from
a seeded generator, so a seed reproduces the tokens.
"""

from __future__ import annotations

import torch

__all__ = ["filter_logits", "choose_tokens", "sampling_rows"]


def sampling_rows(batch: int, temperature: float, top_k: int | None, top_p: float | None, device) -> tuple:
    """``(temperature, top_k, top_p)`` tensors of ``batch`` rows for one setting (``None``: off)."""
    return (
        torch.full((batch,), float(temperature), dtype=torch.float32, device=device),
        torch.full((batch,), int(top_k or 0), dtype=torch.long, device=device),
        torch.full((batch,), 1.0 if top_p is None else float(top_p), dtype=torch.float32, device=device),
    )


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` (float32) divided by each row's temperature (rows at 0 stay as they are), then
    every token outside the row's top-k and top-p set to ``-inf``, as transformers' warpers do."""
    vocab = logits.shape[-1]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ascending, order = scaled.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth_largest = ascending.gather(-1, (vocab - k)[:, None])
    outside_k = scaled < kth_largest
    kept = ascending.masked_fill(ascending < kth_largest, float("-inf"))  # what top-p sorts after top-k
    low_mass = kept.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    low_mass[:, -1] = False  # the most likely token always stays
    low_mass &= (top_p < 1)[:, None]
    outside_p = low_mass.scatter(-1, order, low_mass)
    return scaled.masked_fill(outside_k | outside_p, float("-inf"))


def choose_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """The next token of every row: the argmax where the row's temperature is 0, else a draw from
    its filtered distribution using ``noise [B, V] ~ Exp(1)``."""
    greedy = logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    drawn = (probs / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(-1)  # 0 / 0 would be NaN
    return torch.where(temperature > 0, drawn, greedy)
