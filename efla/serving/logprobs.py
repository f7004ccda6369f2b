"""Log-probabilities for OpenAI's ``logprobs``: of the model's distribution before temperature and
any filter, in float32.

``ServingEngine`` is the decoding engine whose step also keeps, for every row, the log-probability
of the token it chose and the ``MAX_LOGPROBS`` most likely tokens (in the step itself, so a captured
CUDA graph computes them too; read back only when a request asks). ``prompt_logprobs`` scores a
whole prompt with one forward of the model, for ``echo`` with ``logprobs``.
"""

from __future__ import annotations

import torch

from efla.generation import DecodeEngine, choose_tokens
from efla.ops.validate import unchecked_values

from .processors import SlotHistory
from .requests import TokenLogprob

__all__ = ["MAX_LOGPROBS", "ServingEngine", "logprobs_of", "token_logprob", "prompt_logprobs"]

MAX_LOGPROBS = 20  # OpenAI's limit on ``logprobs`` / ``top_logprobs``
_SCORE_ROWS = 256  # prompt positions whose logits are materialised at once


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chosen [B], top_values [B, K], top_ids [B, K])``: the log-probability of each row's token
    and the ``K = MAX_LOGPROBS`` largest ones, of ``logits [B, V]`` (before temperature)."""
    logprobs = logits.float().log_softmax(-1)
    top = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(-1, tokens[:, None])[:, 0], top.values, top.indices


def token_logprob(token: int, chosen: float, top_values: list[float], top_ids: list[int], top: int) -> TokenLogprob:
    return TokenLogprob(token, chosen, list(zip(top_ids[:top], top_values[:top])))


class ServingEngine(DecodeEngine):
    """``DecodeEngine`` whose buckets also hold the step's log-probabilities (``bucket.logprobs``:
    the chosen tokens', the top values and their token ids), and whose step applies the logit
    processors of ``bucket.processors`` (then it runs eagerly: the captured steps have none)."""

    history: SlotHistory | None = None  # the slots' token history, made when a request first needs it

    def slot_history(self) -> SlotHistory:
        if self.history is None:
            self.history = SlotHistory(self.capacity + 1, self.vocab, self.device)
        return self.history

    def step(self, bucket, sampling: bool, generator=None, fill_noise=None) -> None:
        if getattr(bucket, "processors", None) is None:
            super().step(bucket, sampling, generator, fill_noise)
            return
        if sampling and fill_noise is not None:
            fill_noise(bucket.noise)
        elif sampling:
            bucket.noise.exponential_(generator=generator)
        with torch.no_grad(), unchecked_values():
            self._step(bucket, sampling)

    def bucket(self, batch: int):
        bucket = super().bucket(batch)
        if not hasattr(bucket, "logprobs"):
            size, k, dev = bucket.size, min(MAX_LOGPROBS, self.vocab), self.device
            bucket.logprobs = (
                torch.zeros(size, device=dev),
                torch.zeros(size, k, device=dev),
                torch.zeros(size, k, dtype=torch.long, device=dev),
            )
        return bucket

    def _step(self, bucket, sampling: bool) -> None:
        # DecodeEngine._step, keeping the log-probabilities of the logits it chooses from
        hidden = self.decoder(
            input_ids=bucket.tokens[:, None], past_key_values=self._step_cache(bucket), use_cache=True
        ).last_hidden_state
        logits = self.head(hidden[:, 0]).float()
        processors = getattr(bucket, "processors", None)  # None while captured
        chosen_from = logits if processors is None else processors.apply(logits, self.history, bucket.slots)
        if sampling:
            tokens = choose_tokens(chosen_from, bucket.temperature, bucket.top_k, bucket.top_p, bucket.noise)
        else:
            tokens = chosen_from.argmax(-1)
        for static, values in zip(bucket.logprobs, logprobs_of(logits, tokens)):
            static.copy_(values)
        if processors is not None:
            self.history.record(bucket.slots, tokens, processors.active & ~bucket.finished)
        tokens = torch.where(bucket.finished, self.pad_token, tokens)
        stops = self.is_stop_token(tokens)
        bucket.finished |= stops if processors is None else stops & ~processors.keeps_going
        bucket.tokens.copy_(tokens)


@torch.no_grad()
def prompt_logprobs(engine: DecodeEngine, prompt: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (``None`` for the first, which
    has none) and the ``top`` most likely tokens there: one forward of the prompt alone."""
    ids = torch.tensor(prompt, dtype=torch.long, device=engine.device)
    with unchecked_values():
        hidden = engine.decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    entries: list[TokenLogprob | None] = [None]
    for start in range(0, len(prompt) - 1, _SCORE_ROWS):
        end = min(start + _SCORE_ROWS, len(prompt) - 1)
        chosen, values, indices = logprobs_of(engine.head(hidden[start:end]), ids[start + 1 : end + 1])
        for token, c, v, i in zip(prompt[start + 1 : end + 1], chosen.tolist(), values.tolist(), indices.tolist()):
            entries.append(token_logprob(token, c, v, i, top))
    return entries
