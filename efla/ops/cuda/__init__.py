"""GPU fast path for ``efla.ops`` (CUDA tensors only; ``pip install "efla[cuda]"``).

``dispatch(...)`` is called by the public ops after validation, only when ``q.is_cuda``. It
returns ``(o, final_state or None)``, or ``None`` for anything it does not handle, so the caller
runs the PyTorch path instead (with a one-time ``RuntimeWarning`` per reason):

* float32 / float64 inputs (the chunk kernels are bf16/fp16 with a float32 state),
* head dims above 256 (q/k and v checked independently),
* varlen batches with an empty sequence,
* chunk mode (or any mode with autograd) when flash-linear-attention cannot be imported (the
  warning names the import that failed and its error).

On an fla release other than the one whose private stage kernels the chunk path was tested with
(``supported.py``), the chunk ops run fla's public ``chunk_delta_rule`` / ``chunk_gated_delta_rule``
with our coefficients instead (``public_chunk.py``), after one warning.

Design (measured: ``benchmarks/gpu_ops.py``, ``docs/performance.md``):

* chunk mode (training, prefill): flash-linear-attention 0.6.0's WY/UT delta-rule kernels with our
  Triton kernels around them (``chunk.py``): the exact coefficient in one pass over the keys, its
  backward folded into ``dk`` in one pass; Gated EFLA maps onto the gated delta rule (decay log
  ``expm1(g)``, erase ``c``, value ``v * w / c``) and trains on Hopper with Triton < 3.7.1 through
  our own kernel for the one gated backward stage fla refuses there.
* recurrent mode without autograd (decoding): our fused scan kernel (``recurrent.py``), one launch
  per step, coefficient in-kernel. With autograd, recurrent mode runs the chunk path (the same
  recurrence; differences are rounding).
* under ``torch.compile`` the chunk path runs as ``torch.library`` custom ops (``custom_ops.py``),
  one opaque forward and one backward op per call, DeltaNet included; eager calls keep the autograd
  Functions of ``chunk.py``. Varlen batches still break the graph here (the empty-sequence check
  reads ``cu_seqlens``).

``import efla`` imports only ``key_checks`` from here (torch alone: the overflowing-key switch); the
kernels are imported lazily by ``efla.ops``, which treats any exception as "no GPU backend".
"""

from __future__ import annotations

import warnings

import torch

from .supported import fla_stages_tested

__all__ = ["dispatch", "fla_available", "fla_import_error"]

KINDS = ("efla", "gated_efla", "delta_rule", "gated_delta_rule")
MODES = ("chunk", "recurrent")
MAX_HEAD_DIM = 256

_fla_ok = None
_fla_error = None  # "ExceptionType: message" of the import that failed


@torch.compiler.assume_constant_result  # evaluated once while tracing: see ``efla.ops.api._cuda_importable``
def fla_available() -> bool:
    """True when the chunk path's flash-linear-attention functions import: its stage kernels on the
    release they were tested with, its public chunk functions on any other (any failure counts as
    absent; ``fla_import_error`` says which)."""
    global _fla_ok, _fla_error
    if _fla_ok is None:
        try:
            _load_fla()
            _fla_ok = True
        except Exception as error:  # noqa: BLE001 - a broken/partial install must not break efla
            _fla_error = f"{type(error).__name__}: {error}"
            _fla_ok = False
    return _fla_ok


def fla_import_error() -> str | None:
    """What the failed import raised, ``"ExceptionType: message"``; ``None`` while none failed."""
    return _fla_error


def _load_fla() -> None:
    if fla_stages_tested():
        from . import chunk  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)

        chunk.load()
    else:
        from . import public_chunk  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)

        public_chunk.load()


def _chunk_path():
    """The chunk entry: ours around fla's stage kernels, or fla's public functions (``public_chunk``)
    on an fla release those kernels were not tested with."""
    if fla_stages_tested():
        from .custom_ops import chunk_forward  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)
    else:
        from .public_chunk import chunk_forward  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)
    return chunk_forward


_warned: set[str] = set()


def unsupported(q, k, v) -> str | None:
    """Why the GPU kernels cannot take these inputs, or ``None`` when they can."""
    dt = q.dtype
    if dt not in (torch.bfloat16, torch.float16) or k.dtype != dt or v.dtype != dt:
        return f"the GPU kernels take bfloat16/float16 q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return f"the GPU kernels take head dims up to {MAX_HEAD_DIM} (got K={K}, V={V})"
    return None


def fall_back(reason: str) -> None:
    """Warn once per reason that the (slower) PyTorch path runs instead; ``None`` for ``dispatch``."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"efla: {reason}; running the PyTorch path instead", RuntimeWarning, stacklevel=4)
    return None


def _refuse_overflowing_raw_keys(k) -> None:
    """Refuse keys whose ``||k||^2`` overflows float32, as the CPU does, where the kernels cannot
    see it themselves: the Euler rules and fla's public functions (``public_chunk``) form ``k k^T``
    from raw keys, and an in-kernel L2 normalisation turns such a key into a zero key (one reduction
    and one device sync per call; the exact rules' chunk form flags raw keys in its coefficient pass
    instead, and their scan computes them exactly). Skipped where a sync is not allowed (compiled
    code, CUDA-graph capture), where validation has checked them and with ``EFLA_CHECK_KEYS=0``."""
    from ..validate import check_key_energy, values_checked  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)
    from .key_checks import key_checks_enabled  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)

    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing() or values_checked(k) or not key_checks_enabled():
        return
    check_key_energy(k)


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def dispatch(
    kind, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, q_l2norm=False, k_l2norm=False, gates=None
):
    """Run ``kind`` (efla | gated_efla | delta_rule | gated_delta_rule) in ``mode`` (chunk |
    recurrent) on the GPU; ``None`` means "not handled here, use the PyTorch path". ``gates``: raw
    gate inputs (``efla.ops.gates``), which the public ops pass only for the Gated EFLA chunk op
    (every other call gets them activated first).

    Every tensor has the same number of heads: with grouped values the public ops have already
    repeated q and k to one head per value head."""
    if kind not in KINDS or mode not in MODES:
        raise ValueError(f"kind/mode: expected one of {KINDS} / {MODES}, got {kind!r} / {mode!r}")
    if not (q.is_cuda and k.is_cuda and v.is_cuda and beta.is_cuda):
        return None
    dt = q.dtype
    reason = unsupported(q, k, v)
    if reason is not None:
        return fall_back(reason)
    gated = kind in ("gated_efla", "gated_delta_rule")
    if gated and g is None:
        raise ValueError(f"g: required for {kind}")

    if cu_seqlens is not None and cu_seqlens.numel() > 1:
        from ..validate import host_offsets  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)

        cs = host_offsets(cu_seqlens)
        if bool((cs[1:] == cs[:-1]).any()):
            # the chunk kernels assume every sequence has a token
            return fall_back("cu_seqlens holds an empty sequence")

    h0 = initial_state
    if h0 is not None:
        h0 = h0.float().contiguous()  # autograd-aware cast
    cu = cu_seqlens.to(device=q.device, dtype=torch.long).contiguous() if cu_seqlens is not None else None
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    if gated:
        g = g.contiguous()

    if k_l2norm or kind in ("delta_rule", "gated_delta_rule"):
        _refuse_overflowing_raw_keys(k)

    if mode == "recurrent" and not _needs_grad(q, k, v, beta, g, h0):
        from ..normalize import l2_normalize  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)
        from .recurrent import recurrent_forward  # noqa: PLC0415 (lazy: triton, and no import cycle with efla.ops)

        q = l2_normalize(q) if q_l2norm else q
        k = l2_normalize(k) if k_l2norm else k
        return recurrent_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu)

    if not fla_available():
        why = f"the chunk kernels could not be imported ({fla_import_error()})"
        return fall_back(why + '; pip install "efla[cuda]" for Triton and flash-linear-attention')
    if not (fla_stages_tested() or k_l2norm or kind in ("delta_rule", "gated_delta_rule")):
        _refuse_overflowing_raw_keys(k)
    chunk_forward = _chunk_path()

    if kind == "gated_efla" and dt == torch.float16:
        # v * (w / c) grows like 1 / exp(g); bf16 has the range for it, fp16 may not.
        o, ht = chunk_forward(
            kind,
            q.to(torch.bfloat16),
            k.to(torch.bfloat16),
            v.to(torch.bfloat16),
            g,
            beta,
            scale,
            h0,
            output_final_state,
            cu,
            q_l2norm,
            k_l2norm,
            gates,
        )
        return o.to(dt), ht
    return chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu, q_l2norm, k_l2norm, gates)
