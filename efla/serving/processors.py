"""Logit processors of OpenAI's and vLLM's requests: ``logit_bias``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``; and the grammar of a
``response_format`` (``efla.serving.structured``).

The logits are changed in this order, per row: the bias is added; a token in the prompt or the
output so far is divided by ``repetition_penalty`` where positive and multiplied where negative (as
transformers' ``RepetitionPenaltyLogitsProcessor``); ``frequency_penalty`` times a token's count in
the output and ``presence_penalty`` where it occurs at all are subtracted (as OpenAI describes);
while fewer than ``min_tokens`` new tokens exist, the stop tokens are ruled out; so are the tokens
the row's grammar does not allow next. Temperature and top-k/top-p follow. Reported
log-probabilities stay those of the model's own logits.

Each slot's output token counts, prompt tokens and bias live on the device (``SlotHistory``, made on
the first request that needs them). A decoding step with such a request runs eagerly (its bucket's
``processors`` set), never changing the captured steps of the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import structured

__all__ = ["SlotHistory", "RowProcessors", "uses_processors"]


def uses_processors(params) -> bool:
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
        or params.min_tokens
        or params.ignore_eos
        or params.grammar is not None
    )


class SlotHistory:
    """Per slot: the count of each token among its new tokens, the tokens of its prompt, its bias."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.counts = torch.zeros(slots, vocab, device=device)
        self.in_prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(slots, vocab, device=device)

    def start(self, slot: int, prompt: list[int], logit_bias: tuple[tuple[int, float], ...]) -> None:
        """The slot begins a request: no new tokens yet."""
        device = self.counts.device
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.bias[slot].zero_()
        if logit_bias:
            tokens, values = zip(*logit_bias)
            self.bias[slot, torch.tensor(tokens, dtype=torch.long, device=device)] = torch.tensor(values, device=device)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Each of ``rows`` (a mask) produced its token."""
        self.counts.index_put_((slots, tokens), rows.float(), accumulate=True)


@dataclass
class RowProcessors:
    """The processors of a batch's rows (rows without any: ``active`` False, left as they are)."""

    active: torch.Tensor  # [rows] bool
    presence: torch.Tensor  # [rows]
    frequency: torch.Tensor  # [rows]
    repetition: torch.Tensor  # [rows]
    min_tokens: torch.Tensor  # [rows] long
    keeps_going: torch.Tensor  # [rows] bool: ignore_eos (a stop token does not end the row)
    stop_tokens: torch.Tensor  # [rows, vocab] bool: what min_tokens rules out
    matchers: list = field(default_factory=list)  # [rows]: each row's grammar matcher, or None
    allowed: torch.Tensor | None = None  # [rows, vocab] bool: what the grammars allow next (None: no grammar)

    @classmethod
    def of(cls, requests, rows: int, vocab: int, stop_tokens: list[int], device: torch.device) -> RowProcessors:
        """The processors of ``requests`` as the first rows of ``rows`` (the rest inactive); grammars
        are masked once ``constrain`` has run."""
        params = [r.params for r in requests] + [None] * (rows - len(requests))

        def column(value, dtype=torch.float32, neutral=0.0):
            return torch.tensor([value(p) if p is not None else neutral for p in params], dtype=dtype, device=device)

        stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        for row, p in enumerate(params):
            if p is not None and p.min_tokens:
                stops[row, torch.tensor([*stop_tokens, *p.stop_token_ids], dtype=torch.long, device=device)] = True
        return cls(
            active=column(uses_processors, torch.bool, False),
            presence=column(lambda p: p.presence_penalty),
            frequency=column(lambda p: p.frequency_penalty),
            repetition=column(lambda p: p.repetition_penalty, neutral=1.0),
            min_tokens=column(lambda p: p.min_tokens, torch.long, 0),
            keeps_going=column(lambda p: p.ignore_eos, torch.bool, False),
            stop_tokens=stops,
            matchers=[r.matcher for r in requests] + [None] * (rows - len(requests)),
        )

    def constrain(self, vocab: int, device: torch.device, tokens: torch.Tensor | None = None, finished=None) -> None:
        """The grammar rows' masks of the next token, after their matchers take ``tokens`` (each row's
        newest token, which they have not seen; ``None``: nothing new, as before a first token)."""
        if all(m is None for m in self.matchers):
            return
        if tokens is not None:
            structured.advance(self.matchers, tokens.tolist(), finished.tolist())
        self.allowed = structured.allowed_tokens(self.matchers, vocab).to(device)

    def apply(self, logits: torch.Tensor, history: SlotHistory, slots: torch.Tensor) -> torch.Tensor:
        """``logits [rows, vocab]`` (float32) of the rows on ``slots``, processed where active."""
        counts = history.counts[slots]
        processed = logits + history.bias[slots]
        seen = history.in_prompt[slots] | (counts > 0)
        repetition = self.repetition[:, None]
        penalized = torch.where(processed > 0, processed / repetition, processed * repetition)
        processed = torch.where(seen, penalized, processed)
        processed = processed - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        too_early = (counts.sum(-1) < self.min_tokens)[:, None] & self.stop_tokens
        processed = processed.masked_fill(too_early, float("-inf"))
        if self.allowed is not None:
            processed = processed.masked_fill(~self.allowed, float("-inf"))
        return torch.where(self.active[:, None], processed, logits)
