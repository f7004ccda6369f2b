"""Public entry points: validation, layout, varlen and dispatch around the two engines."""

from __future__ import annotations

import contextlib

import torch

from ..variants import Variant
from .torch_chunk import chunk_generic
from .coefficients import coefficients
from .cuda.key_checks import key_checks_enabled
from .gates import RawGates, activate, check_gate_parameters
from .normalize import l2_normalize
from .torch_scan import recurrent_generic
from .validate import check_key_energy, check_result, compute_dtype, host_offsets, validate, values_checked

_cuda_backend = None  # False once the import failed; the module once it succeeded


# torch.compile runs this once while tracing and keeps the answer: a traced read of the flag before
# the import would be guarded on, and the flag's change would recompile on the next call.
@torch.compiler.assume_constant_result
def _cuda_importable() -> bool:
    """Import the GPU backend module once (lazy: the CPU never imports Triton); whether it imported."""
    global _cuda_backend
    if _cuda_backend is None:
        try:
            from . import cuda as backend  # noqa: PLC0415 (lazy: the GPU backend imports triton)

            _cuda_backend = backend
        except Exception:  # noqa: BLE001  any failure (no triton, no fla, broken install) -> PyTorch path
            _cuda_backend = False
    return _cuda_backend is not False


def _cuda():
    """The GPU backend module; ``None`` when it cannot be used."""
    return _cuda_backend if _cuda_importable() else None


def _to_padded(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """[1, T, ...] packed -> [N, Tmax, ...] zero-padded on the right."""
    parts = [x[0, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)


def _from_padded(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    return torch.cat([x[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)]).unsqueeze(0)


def expand_query_key_heads(q: torch.Tensor, k: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped values: repeat each query/key head for its ``groups`` consecutive value heads, so
    value head ``i`` reads q/k head ``i // groups`` (flash-linear-attention's order).

    Every engine then sees ``HV`` heads throughout; autograd sums the group's gradients back
    onto the shared head, so values and gradients are exactly those of the repeated inputs. The
    cost is two copies ``[B, T, HV, K]`` of q and k (``groups`` times their size), which the
    engines (PyTorch and GPU alike) also keep for the backward.
    """
    if groups == 1:
        return q, k
    return q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)


def run(
    rule,
    mode,
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    q_l2norm=False,
    k_l2norm=False,
    gates: RawGates | None = None,
):
    gated = Variant.parse(rule).gated
    g = g if gated else None
    if gates is not None and not _gates_in_kernel(rule, mode, q):
        g, beta = _activated(q, g, beta, gates)
        gates = None
    dims = validate(q, k, v, beta, g, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale, gated=gated)
    if gates is not None:
        check_gate_parameters(gates, dims.HV, q.device)
    scale = float(dims.K**-0.5) if scale is None else float(scale)
    norms = (q_l2norm, k_l2norm)
    q, k = expand_query_key_heads(q, k, dims.groups)
    o, final = _compute(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms, gates)
    if values_checked(q):
        check_result(o, final, q, k, v, beta, initial_state)
    return o, final


def _gates_in_kernel(rule, mode, q) -> bool:
    """Whether raw gates may reach the GPU backend (the Gated EFLA chunk kernels take them; value
    checks and compiled code see the activated values)."""
    return (
        rule == "gated_efla"
        and mode == "chunk"
        and isinstance(q, torch.Tensor)
        and q.is_cuda
        and not values_checked(q)
        and not torch.compiler.is_compiling()
    )


def _activated(q, g, beta, gates):
    """``activate`` after the checks that its arithmetic needs, which hold the raw ``g`` and ``beta``
    to the dtypes the kernels would take (as ``validate`` holds the activated ones)."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    for name, x, also in (("g", g, (torch.float32,)), ("beta", beta, ())):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor of shape [B, T, HV], got {type(x).__name__}")
        if x.dtype not in (q.dtype, *also):
            expected = f"{q.dtype} (same as q)" + (" or torch.float32" if also else "")
            raise ValueError(f"{name}: expected dtype {expected}, got {x.dtype}")
    if gates.gate_in_kernel:
        check_gate_parameters(gates, g.shape[-1], g.device)
    return activate(g, beta, gates)


def _compute(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms, gates=None):
    q_l2norm, k_l2norm = norms
    if q.is_cuda:
        backend = _cuda()
        if backend is not None:
            with _on_device_of(q):
                out = backend.dispatch(
                    rule,
                    mode,
                    q,
                    k,
                    v,
                    g,
                    beta,
                    scale,
                    initial_state,
                    output_final_state,
                    cu_seqlens,
                    q_l2norm=q_l2norm,
                    k_l2norm=k_l2norm,
                    gates=gates,
                )
            if out is not None:
                return out
    g, beta = activate(g, beta, gates)
    if q.is_cuda and not (
        values_checked(k) or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing() or not key_checks_enabled()
    ):
        # the PyTorch engines form k k^T in float32 like the CPU, which always checks this
        # (one device sync per call)
        check_key_energy(k)
    return _compute_torch(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms)


def _on_device_of(x):
    """``x``'s GPU as the current device for the call: Triton launches on the current device, and the
    tensors of a call may live on another (autograd's backward runs on theirs already)."""
    if torch.compiler.is_compiling() or x.device.index is None or x.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(x.device)


def _compute_torch(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms):
    """The PyTorch engines (any device): q/k normalisation, coefficients, varlen padding, then the
    chunk or scan form, in float32 (float64) whatever autocast is on: autocast would run some of the
    engines' products in bf16 and hand their backward mixed dtypes."""
    with torch.autocast(q.device.type, enabled=False):
        return _engines(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms)


def _engines(rule, mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dims, norms):
    H, K, V = dims.HV, dims.K, dims.V  # q and k already carry one head per value head
    cdt = compute_dtype(q.dtype)
    q_l2norm, k_l2norm = norms
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if q_l2norm:
        qc = l2_normalize(qc)
    if k_l2norm:
        kc = l2_normalize(kc)
    gamma, a, w = coefficients(rule, kc, beta, g)
    qc = qc * scale

    cu = None
    if cu_seqlens is not None:
        cu = host_offsets(cu_seqlens).tolist()
        same_factor = w is a
        qc, kc, vc, a = (_to_padded(x, cu) for x in (qc, kc, vc, a))
        w = a if same_factor else _to_padded(w, cu)  # one coefficient stays one tensor
        if gamma is not None:
            gamma = _to_padded(gamma, cu)
    Bp = kc.shape[0]

    if initial_state is None:
        h0 = torch.zeros(Bp * H, K, V, dtype=cdt, device=q.device)
    else:
        h0 = initial_state.to(cdt).reshape(Bp * H, K, V)

    o, S = _engine(mode, qc, kc, vc, gamma, a, w, h0)

    if cu is not None:
        o = _from_padded(o, cu)
    o = o.to(q.dtype).contiguous()
    final = S.reshape(Bp, H, K, V) if output_final_state else None
    return o, final


def _engine(mode, q, k, v, gamma, a, w, h0):
    """Run the chunk or scan form on ``[B, T, H, ...]`` inputs; returns ``o [B, T, H, V]`` and
    the final state ``[B * H, K, V]``."""
    B, T, H, V = v.shape
    if mode == "chunk":

        def batch_major(x):  # [B, T, H, ...] -> [B*H, T, ...]
            return x.transpose(1, 2).reshape(B * H, T, *x.shape[3:])

        q, k, v, gamma, a_bm = (batch_major(x) if x is not None else None for x in (q, k, v, gamma, a))
        w = a_bm if w is a else batch_major(w)  # one coefficient stays one tensor
        o, S = chunk_generic(q, k, v, gamma, a_bm, w, h0)
        return o.reshape(B, H, T, V).transpose(1, 2), S

    def time_major(x):  # [B, T, H, ...] -> [T, B*H, ...]
        return x.transpose(0, 1).reshape(T, B * H, *x.shape[3:])

    args = (time_major(x) if x is not None else None for x in (q, k, v, gamma, a, w))
    o, S = recurrent_generic(*args, h0)
    return o.reshape(T, B, H, V).transpose(0, 1), S
