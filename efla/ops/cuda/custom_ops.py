"""The chunk paths as ``torch.library`` custom ops, so that ``torch.compile`` sees each forward and
each backward as one opaque op (it cannot trace into fla's or our Triton launches).

Registered (namespace ``efla``; ``Tensor?`` = ``None`` allowed):

* ``chunk_delta_fwd(q, k, v, beta, h0?, cu_seqlens?, scale, exact, output_final_state, q_l2norm,
  k_l2norm) -> (o, ht, A, alpha, q_normed, q_rstd, k_normed, k_rstd)``: EFLA (``exact``) or
  DeltaNet;
* ``chunk_delta_bwd(q, q_rstd?, k, k_rstd?, v, beta, alpha, A, h0?, cu_seqlens?, do, dht?, scale,
  exact) -> (dq, dk, dv, dbeta, dh0)``;
* ``chunk_gated_fwd(q, k, v, g, beta, h0?, cu_seqlens?, scale, exact, output_final_state,
  q_l2norm, k_l2norm) -> (o, ht, A, gcum, c, vp, q_normed, q_rstd, k_normed, k_rstd)``: Gated EFLA
  (``exact``) or Gated DeltaNet;
* ``chunk_gated_bwd(q, q_rstd?, k, k_rstd?, v, vp, g, beta, c, gcum, A, h0?, cu_seqlens?, do,
  dht?, scale, exact) -> (dq, dk, dv, dg, dbeta, dh0)``.

A custom op may neither return ``None`` nor return one of its inputs, so a forward output that is
absent or would be an input (``ht`` without ``output_final_state``, ``alpha = beta`` for DeltaNet,
``q`` when not normalised, ...) comes back as an empty placeholder; ``setup_context`` saves the
input in its place. Only ``o`` and ``ht`` are differentiable. The chunk indices of a varlen batch
are derived from ``cu_seqlens`` inside each op.

Eager calls keep the autograd Functions of ``chunk.py`` (no custom-op dispatch cost per call); both
run the same stage functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..gates import activate
from . import chunk as C

_T5 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
_T6 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_T8 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
_T10 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _placeholder(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _as_output(x: Tensor | None, given: Tensor) -> Tensor:
    """``x`` as an op output: a placeholder where it is absent or is the op's input ``given``."""
    return _placeholder(given) if x is None or x is given else x


def _fake_like(present: bool, given: Tensor, *shape, dtype) -> Tensor:
    return given.new_empty(shape, dtype=dtype) if present else _placeholder(given)


def _state_fake(k: Tensor, v: Tensor, cu_seqlens, present: bool) -> Tensor:
    n = k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return _fake_like(present, k, n, k.shape[2], k.shape[3], v.shape[3], dtype=torch.float32)


def _norm_fakes(x: Tensor, present: bool) -> tuple[Tensor, Tensor]:
    normed = x.new_empty(x.shape) if present else _placeholder(x)
    return normed, _fake_like(present, x, *x.shape[:-1], dtype=torch.float32)


def _normed_inputs(q, k, normed, q_l2norm, k_l2norm):
    """``(q, q_rstd, k, k_rstd)`` for the backward: the op's normalised outputs where it normalised."""
    qn, q_rstd, kn, k_rstd = normed
    return (qn if q_l2norm else q, q_rstd if q_l2norm else None, kn if k_l2norm else k, k_rstd if k_l2norm else None)


# ------------------------------------------------------------------ EFLA / DeltaNet
@torch.library.custom_op("efla::chunk_delta_fwd", mutates_args=())
def chunk_delta_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    exact: bool,
    output_final_state: bool,
    q_l2norm: bool,
    k_l2norm: bool,
) -> _T8:
    C.load()
    o, ht, A, alpha, qn, q_rstd, kn, k_rstd = C.delta_fwd(
        q, k, v, beta, h0, scale, output_final_state, cu_seqlens, exact, q_l2norm, k_l2norm
    )
    return (
        o,
        _as_output(ht, k),
        A,
        _as_output(alpha, beta),
        _as_output(qn, q),
        _as_output(q_rstd, q),
        _as_output(kn, k),
        _as_output(k_rstd, k),
    )


@chunk_delta_fwd.register_fake
def _(q, k, v, beta, h0, cu_seqlens, scale, exact, output_final_state, q_l2norm, k_l2norm):
    B, T, H, _ = k.shape
    alpha = _fake_like(exact, beta, B, T, H, dtype=C.COEF_DTYPE.get(k.dtype, torch.float32))
    return (
        torch.empty_like(v),
        _state_fake(k, v, cu_seqlens, output_final_state),
        k.new_empty(B, T, H, C.CHUNK),
        alpha,
        *_norm_fakes(q, q_l2norm),
        *_norm_fakes(k, k_l2norm),
    )


@torch.library.custom_op("efla::chunk_delta_bwd", mutates_args=())
def chunk_delta_bwd(
    q: Tensor,
    q_rstd: Tensor | None,
    k: Tensor,
    k_rstd: Tensor | None,
    v: Tensor,
    beta: Tensor,
    alpha: Tensor,
    A: Tensor,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    scale: float,
    exact: bool,
) -> _T5:
    C.load()
    dq, dk, dv, dbeta, dh0 = C.delta_bwd(q, q_rstd, k, k_rstd, v, beta, alpha, A, h0, cu_seqlens, do, dht, scale, exact)
    return dq, dk, dv, dbeta, _as_output(dh0, k)


@chunk_delta_bwd.register_fake
def _(q, q_rstd, k, k_rstd, v, beta, alpha, A, h0, cu_seqlens, do, dht, scale, exact):
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else _placeholder(k)
    return q.new_empty(q.shape), k.new_empty(k.shape), torch.empty_like(v), torch.empty_like(beta), dh0


def _delta_setup(ctx, inputs, output):
    q, k, v, beta, h0, cu_seqlens, scale, exact, output_final_state, q_l2norm, k_l2norm = inputs
    o, ht, A, alpha, *normed = output
    ctx.mark_non_differentiable(A, alpha, *normed, *(() if output_final_state else (ht,)))
    ctx.set_materialize_grads(False)  # outputs without a gradient get None, not a tensor of zeros
    qn, q_rstd, kn, k_rstd = _normed_inputs(q, k, normed, q_l2norm, k_l2norm)
    ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, beta, alpha if exact else beta, A, h0, cu_seqlens)
    ctx.scale, ctx.exact, ctx.output_final_state = scale, exact, output_final_state


def _delta_backward(ctx, do, dht, *_):
    qn, q_rstd, kn, k_rstd, v, beta, alpha, A, h0, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do  # only the final state was used
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dbeta, dh0 = torch.ops.efla.chunk_delta_bwd(
        qn, q_rstd, kn, k_rstd, v, beta, alpha, A, h0, cu_seqlens, do, dht, ctx.scale, ctx.exact
    )
    return dq, dk, dv, dbeta, (dh0 if h0 is not None else None), None, None, None, None, None, None


chunk_delta_fwd.register_autograd(_delta_backward, setup_context=_delta_setup)


# ------------------------------------------------------------------ Gated EFLA / Gated DeltaNet
@torch.library.custom_op("efla::chunk_gated_fwd", mutates_args=())
def chunk_gated_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    exact: bool,
    output_final_state: bool,
    q_l2norm: bool,
    k_l2norm: bool,
) -> _T10:
    C.load()
    o, ht, A, gcum, c, vp, qn, q_rstd, kn, k_rstd = C.gated_fwd(
        q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, exact, q_l2norm, k_l2norm
    )
    return (
        o,
        _as_output(ht, k),
        A,
        gcum,
        _as_output(c, beta),
        _as_output(vp, v),
        _as_output(qn, q),
        _as_output(q_rstd, q),
        _as_output(kn, k),
        _as_output(k_rstd, k),
    )


@chunk_gated_fwd.register_fake
def _(q, k, v, g, beta, h0, cu_seqlens, scale, exact, output_final_state, q_l2norm, k_l2norm):
    B, T, H, _ = k.shape
    c = _fake_like(exact, beta, B, T, H, dtype=C.COEF_DTYPE.get(k.dtype, torch.float32))
    vp = torch.empty_like(v) if exact else _placeholder(v)
    return (
        torch.empty_like(v),
        _state_fake(k, v, cu_seqlens, output_final_state),
        k.new_empty(B, T, H, C.CHUNK),
        k.new_empty(B, T, H, dtype=torch.float32),
        c,
        vp,
        *_norm_fakes(q, q_l2norm),
        *_norm_fakes(k, k_l2norm),
    )


@torch.library.custom_op("efla::chunk_gated_bwd", mutates_args=())
def chunk_gated_bwd(
    q: Tensor,
    q_rstd: Tensor | None,
    k: Tensor,
    k_rstd: Tensor | None,
    v: Tensor,
    vp: Tensor,
    g: Tensor,
    beta: Tensor,
    c: Tensor,
    gcum: Tensor,
    A: Tensor,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    scale: float,
    exact: bool,
) -> _T6:
    C.load()
    dq, dk, dv, dg, dbeta, dh0 = C.gated_bwd(
        q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, cu_seqlens, do, dht, scale, exact
    )
    return dq, dk, dv, dg, dbeta, _as_output(dh0, k)


@chunk_gated_bwd.register_fake
def _(q, q_rstd, k, k_rstd, v, vp, g, beta, c, gcum, A, h0, cu_seqlens, do, dht, scale, exact):
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else _placeholder(k)
    return (q.new_empty(q.shape), k.new_empty(k.shape), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta), dh0)


def _gated_setup(ctx, inputs, output):
    q, k, v, g, beta, h0, cu_seqlens, scale, exact, output_final_state, q_l2norm, k_l2norm = inputs
    o, ht, A, gcum, c, vp, *normed = output
    ctx.mark_non_differentiable(A, gcum, c, vp, *normed, *(() if output_final_state else (ht,)))
    ctx.set_materialize_grads(False)
    qn, q_rstd, kn, k_rstd = _normed_inputs(q, k, normed, q_l2norm, k_l2norm)
    ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, vp if exact else v, g, beta, c if exact else beta, gcum, A, h0, cu_seqlens)
    ctx.scale, ctx.exact, ctx.output_final_state = scale, exact, output_final_state


def _gated_backward(ctx, do, dht, *_):
    qn, q_rstd, kn, k_rstd, v, vp, g, beta, c, gcum, A, h0, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.efla.chunk_gated_bwd(
        qn, q_rstd, kn, k_rstd, v, vp, g, beta, c, gcum, A, h0, cu_seqlens, do, dht, ctx.scale, ctx.exact
    )
    return dq, dk, dv, dg, dbeta, (dh0 if h0 is not None else None), None, None, None, None, None, None


chunk_gated_fwd.register_autograd(_gated_backward, setup_context=_gated_setup)


# ------------------------------------------------------------------ entry
def op_chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm, k_l2norm):
    """``(o, final_state or None)`` through the custom ops."""
    if kind in ("efla", "delta_rule"):
        out = torch.ops.efla.chunk_delta_fwd(
            q, k, v, beta, h0, cu_seqlens, scale, kind == "efla", output_final_state, q_l2norm, k_l2norm
        )
    else:
        out = torch.ops.efla.chunk_gated_fwd(
            q, k, v, g, beta, h0, cu_seqlens, scale, kind == "gated_efla", output_final_state, q_l2norm, k_l2norm
        )
    return out[0], (out[1] if output_final_state else None)


def chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm=False, k_l2norm=False, gates=None):
    """Returns (o, final_state or None). Inputs already checked by the dispatcher. Under
    ``torch.compile`` the custom ops (raw ``gates`` activated first), in eager the autograd
    Functions (same stages; Gated EFLA's take the raw gates)."""
    C.load()
    if torch.compiler.is_compiling():
        g, beta = activate(g, beta, gates)
        return op_chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm, k_l2norm)
    return C.eager_chunk_forward(kind, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, q_l2norm, k_l2norm, gates)
