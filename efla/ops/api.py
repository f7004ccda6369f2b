"""Public entry points: validation, layout, varlen and dispatch around the two engines."""

from __future__ import annotations

import os

import torch

from .chunk import chunk_generic
from .coefficients import coefficients
from .normalize import l2_normalize
from .recurrent import recurrent_generic
from .validate import validate

_cuda_backend = None  # False once the import failed; the module once it succeeded


def _cuda():
    """The GPU backend module, imported lazily; ``None`` when it cannot be used."""
    global _cuda_backend
    if _cuda_backend is None:
        try:
            from . import cuda as backend  # noqa: PLC0415 (lazy: CPU never imports Triton)

            _cuda_backend = backend
        except Exception:  # any failure (no triton, no fla, broken install) -> PyTorch path
            _cuda_backend = False
    return _cuda_backend or None


def _check_values(q: torch.Tensor) -> bool:
    # Scanning every input for NaN/Inf costs a device sync and a full read on a GPU, so there it
    # is opt-in (EFLA_CHECK_VALUES=1); on CPU it is always on.
    if not q.is_cuda:
        return True
    return os.environ.get("EFLA_CHECK_VALUES", "0") not in ("", "0", "false", "False")


def _to_padded(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """[1, T, ...] packed -> [N, Tmax, ...] zero-padded on the right."""
    parts = [x[0, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)


def _from_padded(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    return torch.cat([x[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)]).unsqueeze(0)


def run(rule, mode, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, q_l2norm=False,
        k_l2norm=False):
    gated = rule in ("gated_efla", "gated_delta_rule")
    dims = validate(
        q, k, v, beta, g, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale, gated=gated,
        check_values=_check_values(q),
    )
    B, T, H, K, V, N = dims.B, dims.T, dims.H, dims.K, dims.V, dims.N
    scale = float(K ** -0.5) if scale is None else float(scale)

    if q.is_cuda:
        backend = _cuda()
        if backend is not None:
            out = backend.dispatch(
                rule, mode, q, k, v, g if gated else None, beta, scale, initial_state, output_final_state, cu_seqlens,
                q_l2norm=q_l2norm, k_l2norm=k_l2norm,
            )
            if out is not None:
                return out

    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if q_l2norm:
        qc = l2_normalize(qc)
    if k_l2norm:
        kc = l2_normalize(kc)
    gamma, a, w = coefficients(rule, kc, beta, g if gated else None)
    qc = qc * scale

    cu = None
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
        qc, kc, vc, a, w = (_to_padded(x, cu) for x in (qc, kc, vc, a, w))
        if gamma is not None:
            gamma = _to_padded(gamma, cu)
    Bp, Tp = kc.shape[0], kc.shape[1]

    if initial_state is None:
        h0 = torch.zeros(Bp * H, K, V, dtype=cdt, device=q.device)
    else:
        h0 = initial_state.to(cdt).reshape(Bp * H, K, V)

    if mode == "chunk":
        def bm(x):  # [B, T, H, ...] -> [B*H, T, ...]
            return x.transpose(1, 2).reshape(Bp * H, Tp, *x.shape[3:])

        o, S = chunk_generic(bm(qc), bm(kc), bm(vc), None if gamma is None else bm(gamma), bm(a), bm(w), h0)
        o = o.reshape(Bp, H, Tp, V).transpose(1, 2)
    else:
        def tm(x):  # [B, T, H, ...] -> [T, B*H, ...]
            return x.transpose(0, 1).reshape(Tp, Bp * H, *x.shape[3:])

        o, S = recurrent_generic(tm(qc), tm(kc), tm(vc), None if gamma is None else tm(gamma), tm(a), tm(w), h0)
        o = o.reshape(Tp, Bp, H, V).transpose(0, 1)

    if cu is not None:
        o = _from_padded(o, cu)
    o = o.to(q.dtype).contiguous()
    final = S.reshape(Bp, H, K, V) if output_final_state else None
    return o, final
