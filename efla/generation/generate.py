"""``generate``: transformers-style generation through the decoding engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .engine import DecodeEngine, engine_for
from .speculative import _Sampler, speculative_config, speculative_generate

__all__ = ["generate"]

_SYNC_EVERY = 8  # steps between the host's reads of the device (stop check, streaming)
_SYNC_EVERY_STREAMING = 2


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens (those under a 1 of the left-padding mask)."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.long, torch.int, torch.int16, torch.uint8)
    ):
        raise ValueError(
            f"input_ids: expected an integer tensor [B, T], got "
            f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
        )
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected at least one row of at least one token, got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids.long())
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.long().cpu()
    lengths = mask.sum(1)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask: expected only 0 and 1 values")
    left_padded = torch.arange(mask.shape[1]) >= (mask.shape[1] - lengths)[:, None]
    if not torch.equal(mask.bool(), left_padded):
        raise ValueError("attention_mask: expected left padding (each row's tokens at the end, its 0s before them)")
    if bool((lengths == 0).any()):
        raise ValueError(f"attention_mask: row {int((lengths == 0).nonzero()[0])} has no token")
    ids = input_ids.long()
    return [ids[i, ids.shape[1] - int(n) :] for i, n in enumerate(lengths)]


def _stop_tokens(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id: expected a token id or a list of them, got {eos_token_id!r}")
    return ids


def _pad_token(model, pad_token_id, stop_tokens) -> int:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = stop_tokens[0] if stop_tokens else 0
    return int(pad_token_id)


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a value >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k: expected an int >= 0 (0 or None: off), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1] (1 or None: off), got {top_p!r}")


def _row_noise(device: torch.device, seeds: list[int]) -> Callable[[torch.Tensor], None]:
    """``fill_noise`` for the engine: row ``r``'s noise from a generator of its own seeded by
    ``seeds[r]``, so a row's sample depends on its seed and prompt alone, not on the rows beside it."""
    generators = [_generator(device, seed) for seed in seeds]

    def fill(noise: torch.Tensor) -> None:
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)

    return fill


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator of its own, seeded by ``seed`` or else from torch's global generator (so
    ``torch.manual_seed`` reproduces an unseeded call, as with transformers)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) if seed is not None else int(torch.randint(2**62, (), dtype=torch.long)))
    return generator


class _HostReads:
    """Reads the device every few steps without stalling it: each read's copies are queued behind
    the step and looked at one read later, when they have long arrived."""

    def __init__(self, new_tokens: torch.Tensor, finished: torch.Tensor, streamer):
        self.new_tokens, self.finished, self.streamer = new_tokens, finished, streamer
        self.streamed = 0
        self.pending = None
        self.done = False

    def queue(self, steps: int) -> None:
        """Queue the copies of the tokens made so far (for the streamer) and of the stop flag."""
        self.collect()
        all_finished = self.finished.all()
        tokens = self.new_tokens[:, self.streamed : steps] if self.streamer is not None else None
        if self.new_tokens.is_cuda:
            all_finished = all_finished.to("cpu", non_blocking=True)
            tokens = tokens.to("cpu", non_blocking=True) if tokens is not None else None
            event = torch.cuda.Event()
            event.record()
        else:
            event = None
        self.pending = (event, all_finished, tokens, steps)

    def collect(self) -> None:
        if self.pending is None:
            return
        event, all_finished, tokens, steps = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        self.done = self.done or bool(all_finished)
        if tokens is not None:
            for j in range(tokens.shape[1]):
                self.streamer.put(tokens[:, j])
            self.streamed = steps


def _new_tokens_needed(new_tokens: torch.Tensor, steps: int, engine: DecodeEngine) -> int:
    """How many new tokens transformers' ``generate`` would keep: up to the step where the last row
    produced a stop token (all ``steps`` if a row never did)."""
    made = new_tokens[:, :steps]
    stopped = torch.isin(made, engine.stop_tokens[engine.stop_tokens >= 0])
    if not bool(stopped.any(1).all()):
        return steps
    return int(stopped.int().argmax(1).max()) + 1


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | Sequence[int] | None = None,
    streamer=None,
    *,
    pad_token_id: int | None = None,
    use_cuda_graph: bool | None = None,
    speculate=None,
    speculation_stats: dict | None = None,
) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt, like transformers'
    ``model.generate``, through the decoding engine (``efla.generation.DecodeEngine``).

    Args:
        model: an ``EFLAForCausalLM`` (any variant, hybrid models included), in eval mode.
        input_ids: ``[B, T]`` prompts, left-padded where their lengths differ.
        attention_mask: ``[B, T]`` 0/1, 0 on the left padding (``None``: no padding).
        max_new_tokens: tokens to generate per row (fewer when every row stopped).
        temperature: ``0`` greedy; above 0, sampling from ``softmax(logits / temperature)``.
        top_k / top_p: sampling filters, as transformers' warpers (``None``: off).
        eos_token_id: stop token(s); ``None``: the model's ``generation_config.eos_token_id``; ``[]``:
            never stop early. A row that stopped continues with ``pad_token_id``.
        seed: seeds the sampling (same seed, same tokens); ``None`` draws one from torch's global
            generator; a sequence gives each row its own seed, and a row's tokens then depend only on
            its seed and prompt (the same as that prompt generated alone with ``seed=[its seed]``).
        streamer: a transformers streamer (``put`` / ``end``): gets the prompts, then each step's
            tokens ``[B]`` (a few steps at a time: the host reads the device every few steps).
        pad_token_id: ``None``: the model's ``generation_config.pad_token_id``, else the first stop
            token, else 0.
        use_cuda_graph: replay each step from a CUDA graph (default: on CUDA).
        speculate: speculative decoding (``efla.generation.speculative``): ``None`` (off), a
            ``SpeculativeConfig`` or a dict of its fields with vLLM's names, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}`` (prompt lookup)
            or ``{"method": "draft_model", "model": draft, "num_speculative_tokens": 4}``. Greedy
            tokens are the same as without; sampled tokens have the same distribution (not the same
            draws for a seed). The steps run eagerly (no CUDA graph).
        speculation_stats: a dict that speculation fills with ``rounds`` (target passes),
            ``drafted``, ``accepted`` and ``tokens``.

    Returns:
        ``[B, T + n]`` long: ``input_ids`` followed by the ``n <= max_new_tokens`` new tokens.

    Prompts are prefilled together by the chunk kernels (packed, no padding); each decoding step
    runs every layer on one token per row with the states updated in place, and on CUDA one
    captured graph per batch bucket replays it. The engine's state pool stays allocated on the
    model between calls (``efla.generation.release(model)`` frees it).
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    prompts = _prompts(input_ids, attention_mask)
    stop_tokens = _stop_tokens(model, eos_token_id)
    speculation = speculative_config(speculate)
    engine = engine_for(model, use_cuda_graph)
    engine.check_weights()
    batch = len(prompts)
    if speculation is not None:
        return _speculative(
            model,
            engine,
            input_ids,
            prompts,
            speculation,
            max_new_tokens,
            (temperature, top_k, top_p),
            seed,
            stop_tokens,
            _pad_token(model, pad_token_id, stop_tokens),
            streamer,
            speculation_stats,
        )
    engine.reserve(batch, max(len(p) for p in prompts) + max_new_tokens)
    engine.set_stop_tokens(stop_tokens, _pad_token(model, pad_token_id, stop_tokens))
    bucket = engine.bucket(batch)
    rows = torch.arange(batch, device=engine.device)
    engine.assign(bucket, rows)
    sampling = temperature > 0
    for tensor, value in (
        (bucket.temperature, float(temperature)),
        (bucket.top_k, int(top_k or 0)),
        (bucket.top_p, 1.0 if top_p is None else float(top_p)),
    ):
        tensor.fill_(value)
    per_row = isinstance(seed, (list, tuple))
    if per_row and len(seed) != batch:
        raise ValueError(f"seed: expected one seed per prompt ({batch}), got {len(seed)}")
    generator = _generator(engine.device, seed) if sampling and not per_row else None
    fill_noise = _row_noise(engine.device, list(seed)) if sampling and per_row else None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    logits = engine.prefill(prompts, rows)
    engine.start(bucket, logits, generator, fill_noise)
    new_tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=engine.device)
    new_tokens[:, 0] = bucket.tokens[:batch]
    reads = _HostReads(new_tokens, bucket.finished, streamer)
    sync_every = _SYNC_EVERY_STREAMING if streamer is not None else _SYNC_EVERY
    steps = 1
    while steps < max_new_tokens and not reads.done:
        if steps % sync_every == 0:
            reads.queue(steps)
        engine.step(bucket, sampling, generator, fill_noise)
        new_tokens[:, steps] = bucket.tokens[:batch]
        steps += 1
    reads.queue(steps)
    reads.collect()
    if streamer is not None:
        streamer.end()
    kept = _new_tokens_needed(new_tokens, steps, engine)
    return torch.cat([input_ids.to(new_tokens.device).long(), new_tokens[:, :kept]], dim=1)


def _speculative(
    model, engine, input_ids, prompts, config, max_new_tokens, settings, seed, stop_tokens, pad_token, streamer, stats
):
    """``generate`` through speculative decoding: the same output shape and padding."""
    batch = len(prompts)
    if isinstance(seed, (list, tuple)):
        if len(seed) != batch:
            raise ValueError(f"seed: expected one seed per prompt ({batch}), got {len(seed)}")
        generators = [_generator(engine.device, s) for s in seed]
    else:
        generators = [_generator(engine.device, seed)] * batch
    sampler = _Sampler(*settings, generators, engine.device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    new = speculative_generate(model, engine, prompts, config, max_new_tokens, sampler, stop_tokens, pad_token, streamer, stats)
    if streamer is not None:
        streamer.end()
    stopped = all(row and row[-1] in stop_tokens for row in new)
    kept = max(map(len, new)) if stopped else max_new_tokens
    out = torch.full((batch, kept), pad_token, dtype=torch.long)
    for r, row in enumerate(new):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return torch.cat([input_ids.long(), out.to(input_ids.device)], dim=1)
