"""Fast generation: a decoding state allocated once and updated in place, prompts prefilled by the
chunk kernels, and a decoding step replayed from a CUDA graph per batch bucket.

``generate(model, input_ids, ...)`` is the entry point (transformers-style arguments and output);
``DecodeEngine`` is the state pool and step it runs on, which a server can drive row by row
(``cache.slots``); ``choose_tokens`` / ``filter_logits`` pick tokens per row on the device;
``generate(..., speculate=SpeculativeConfig(...))`` decodes speculatively (``efla.generation.speculative``).
"""

from .engine import Bucket, DecodeEngine, bucket_size, engine_for, release
from .generate import generate
from .sampling import choose_tokens, filter_logits, sampling_rows
from .speculative import SpeculativeConfig

__all__ = [
    "generate",
    "DecodeEngine",
    "Bucket",
    "bucket_size",
    "engine_for",
    "release",
    "choose_tokens",
    "filter_logits",
    "sampling_rows",
    "SpeculativeConfig",
]
