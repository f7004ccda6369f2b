"""The fused decoding step of the token mixers against their general code, on a slot pool.

Shared by the CUDA test and the same check under Triton's CPU interpreter (a subprocess that calls
:func:`main`). Each case builds a layer, a pool of random states and convolution histories, and
decodes one token for a few batch rows that point at scattered pool rows; the fused step must give
the general path's output and leave every pool row as the general path leaves it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from unittest import mock

import torch

from efla.layers import EFLA, GatedEFLA
from efla.layers import fla_kernels as fused
from efla.models.cache import EFLACache

CASES = {
    "efla": lambda: EFLA(hidden_size=64, num_heads=2, update_rule="exact", layer_idx=0),
    "efla-gate-neg-bias": lambda: EFLA(
        hidden_size=64, num_heads=2, use_gate=True, allow_neg_eigval=True, conv_bias=True, layer_idx=0
    ),
    "efla-grouped": lambda: EFLA(hidden_size=64, num_heads=2, num_v_heads=4, layer_idx=0),
    "deltanet": lambda: EFLA(hidden_size=64, num_heads=2, update_rule="euler", layer_idx=0),
    "deltanet-identity-nobeta": lambda: EFLA(
        hidden_size=64, num_heads=2, update_rule="euler", qk_activation="identity", use_beta=False, layer_idx=0
    ),
    "gated-efla": lambda: GatedEFLA(hidden_size=64, head_dim=16, num_heads=2, expand_v=1, layer_idx=0),
    "gated-efla-grouped-sigmoid": lambda: GatedEFLA(
        hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=2, output_gate_activation="sigmoid", layer_idx=0
    ),
    "gated-deltanet": lambda: GatedEFLA(
        hidden_size=64, head_dim=16, num_heads=2, expand_v=1, update_rule="euler", allow_neg_eigval=True, layer_idx=0
    ),
}
SLOTS = [3, 0, 5]  # batch row b reads and writes pool row SLOTS[b]; rows 1, 2, 4 must stay as they were
POOL_ROWS = 6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _layer(name: str, device, dtype, stiff: bool):
    torch.manual_seed(0)
    layer = CASES[name]().to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        if stiff:  # keys with ||k||^2 in the hundreds: where the exact and Euler steps part
            layer.k_proj.weight.mul_(20.0)
    return layer


def _cache(layer, device, dtype) -> EFLACache:
    cache = EFLACache(1)
    state = layer.empty_state(POOL_ROWS, device, dtype)
    state["recurrent_state"].normal_()
    for history in state["conv_state"] or ():
        history.normal_()
    cache.states[0] = state
    cache.slots = torch.tensor(SLOTS, device=device)
    return cache


def _pool_tensors(cache: EFLACache) -> list[torch.Tensor]:
    state = cache.states[0]
    return [state["recurrent_state"], *(state["conv_state"] or ())]


def compare(name: str, device="cpu", dtype=torch.float32, stiff=False, blocks: int | None = None) -> list[float]:
    """Relative errors (fused step vs general code) of the output and of each pool tensor; ``blocks``:
    the GPU kernel's blocks of value columns per head (``None``: its own choice)."""
    layer = _layer(name, device, dtype, stiff)
    x = torch.randn(len(SLOTS), 1, layer.hidden_size, device=device, dtype=dtype)
    ref_cache, got_cache = _cache(layer, device, dtype), None
    got_cache = EFLACache(1)
    got_cache.states[0] = {
        "recurrent_state": ref_cache.states[0]["recurrent_state"].clone(),
        "conv_state": tuple(h.clone() for h in ref_cache.states[0]["conv_state"] or ()) or None,
    }
    got_cache.slots = ref_cache.slots
    with torch.no_grad():
        with fused.disabled():
            want = layer(x, past_key_values=ref_cache, use_cache=True)[0]
        with _value_blocks(device, blocks):
            got = layer._fused_step(x, got_cache.states[0], got_cache)
    return [rel(got, want)] + [rel(a, b) for a, b in zip(_pool_tensors(got_cache), _pool_tensors(ref_cache))]


@contextlib.contextmanager
def _value_blocks(device, blocks):
    """The Triton kernel with ``blocks`` value blocks per head: on a GPU, or on CPU tensors under
    Triton's interpreter (where ``fused_decode_step`` itself would take its PyTorch form)."""
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from efla.layers import single_step as layer_decode
    from efla.ops.cuda import decode

    with (
        decode.value_blocks(blocks),
        mock.patch.object(layer_decode, "fused_decode_step", decode.decode_step if on_cpu else layer_decode.fused_decode_step),
    ):
        yield


def main() -> int:
    """Under Triton's interpreter (TRITON_INTERPRET=1): every case in float32, one line per error."""
    for name in CASES:
        for stiff in (False, True):
            for blocks in (1, 2):
                for i, err in enumerate(compare(name, stiff=stiff, blocks=blocks)):
                    print(name, stiff, blocks, i, err, sep="\t")
    return 0


if __name__ == "__main__":
    sys.exit(main())
