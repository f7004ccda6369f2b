"""Log-probabilities as OpenAI's responses write them.

Completions (``logprobs``): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a mapping of
the most likely tokens' text to their log-probabilities, the chosen token among them) and
``text_offset`` (where each token's text starts, counted from the start of the prompt, as OpenAI's
legacy completions count it). A prompt's first token has no log-probability (``None``). Chat
(``logprobs.content``): per token its text, log-probability, UTF-8 bytes and ``top_logprobs``.
A token's text is the tokenizer's decoding of it alone.
"""

from __future__ import annotations

from .requests import TokenLogprob

__all__ = ["TokenTexts", "completion_logprobs", "chat_logprobs"]


class TokenTexts:
    """Each token's text (cached)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._texts = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


def completion_logprobs(
    texts: TokenTexts, tokens: list[int], entries: list[TokenLogprob | None], offset: int
) -> tuple[dict, int]:
    """The ``logprobs`` object of ``tokens`` (their entries: ``None`` where a token has no
    log-probability) whose text starts at ``offset``; and the offset after them."""
    obj = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts(token)
        obj["tokens"].append(text)
        obj["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            obj["token_logprobs"].append(None)
            obj["top_logprobs"].append(None)
            continue
        obj["token_logprobs"].append(entry.logprob)
        top: dict[str, float] = {}
        for t, logprob in entry.top:  # most likely first: tokens of the same text keep the larger value
            top.setdefault(texts(t), logprob)
        top.setdefault(text, entry.logprob)
        obj["top_logprobs"].append(top)
    return obj, offset


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    """The ``logprobs`` object of a chat choice's tokens."""

    def described(token: int, logprob: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**described(e.token, e.logprob), "top_logprobs": [described(t, lp) for t, lp in e.top]} for e in entries]
    }
