"""Serving: an OpenAI-compatible HTTP server (``efla serve``) with continuous batching over the
decoding engine's pool of recurrent states.

``Scheduler`` owns the model in a background thread and batches requests step by step (chunked
prefill, a prefix state cache, forked states for ``n`` choices, per-request seeds, log-probabilities,
logit processors); ``create_app`` puts OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, vLLM's ``/tokenize`` and ``/detokenize``, Prometheus ``/metrics`` and a ``/health``
report in front of it (FastAPI; ``pip install "efla[serve]"``).
"""

from .prefix_cache import PrefixCache
from .requests import ErrorEvent, FinishEvent, QueueFull, Request, SamplingParams, ShuttingDown, TokenEvent, TokenLogprob
from .scheduler import Scheduler, prefill_defaults

__all__ = [
    "Scheduler",
    "SamplingParams",
    "Request",
    "TokenEvent",
    "TokenLogprob",
    "FinishEvent",
    "ErrorEvent",
    "QueueFull",
    "ShuttingDown",
    "PrefixCache",
    "create_app",
    "prefill_defaults",
]


def __getattr__(name):
    if name == "create_app":  # FastAPI is an optional dependency: imported when the app is asked for
        from .app import create_app  # noqa: PLC0415 (lazy: fastapi is the optional efla[serve] extra)

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
