"""Route the token mixers through the context-parallel scope for tests, the way the layers will:
the op through ``context_parallel_aware`` and the convolution caches from
``context_parallel_conv_states``. Does nothing for a layer whose module already does so."""

from __future__ import annotations

import contextlib
import inspect
import sys

from efla.distributed import context_parallel_aware, context_parallel_conv_states, current_context
from efla.layers import EFLA, GatedEFLA


def _already_routed(layer_class) -> bool:
    classes = [c for c in layer_class.__mro__ if c.__module__.startswith("efla.")]
    source = "".join(inspect.getsource(sys.modules[c.__module__]) for c in classes)
    return "context_parallel_aware" in source and "context_parallel_conv_states" in source


def _routed_op(original):
    def _op(self, recurrent):
        return context_parallel_aware(original(self, recurrent))

    return _op


def _prepare_with_history(original):
    def prepare_qkv_beta(self, hidden_states, attention_mask=None, last_state=None, use_cache=False, cu_seqlens=None):
        if current_context() is not None and self.use_short_conv and last_state is None:
            x = hidden_states  # the projections again: the same inputs of the convolutions
            inputs = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
            last_state = {"conv_state": context_parallel_conv_states(inputs, self.conv_size)}
        return original(self, hidden_states, attention_mask, last_state, use_cache, cu_seqlens)

    return prepare_qkv_beta


@contextlib.contextmanager
def token_mixers_routed():
    patched = [c for c in (EFLA, GatedEFLA) if not _already_routed(c)]
    saved = [(c, c._op, c.prepare_qkv_beta) for c in patched]
    for c in patched:
        c._op = _routed_op(c._op)
        c.prepare_qkv_beta = _prepare_with_history(c.prepare_qkv_beta)
    try:
        yield
    finally:
        for c, op, prepare in saved:
            c._op, c.prepare_qkv_beta = op, prepare
