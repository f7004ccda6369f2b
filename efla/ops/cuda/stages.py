"""fla's chunk kernels (flash-linear-attention 0.6.0), launched by us through ``launch``.

Each function here allocates what one of fla's stage functions allocates and launches the same
kernel with the same arguments and tile sizes, so the results are those of fla's function (the
Triton-interpreter tests compare them); what differs is the host side: a launch after the first
goes straight to the compiled kernel (``launch.py``), without fla's backend dispatch and Triton's
autotuner wrappers on every call. Shapes: ``[B, T, H, K]`` keys, one value head per key head.

These kernels are fla's private ones, so they run only on the fla release listed in
``supported.TESTED_FLA``; on any other the chunk ops take fla's public functions
(``public_chunk.py``).
"""

from __future__ import annotations

import functools

import torch
import triton

from efla import environment

from .launch import launch

CHUNK = 64
RCP_LN2 = 1.4426950408889634  # the gated kernels take the gate's cumsum in base 2


@functools.cache
def kernels() -> dict:
    from fla.ops.common import chunk_delta_h, chunk_o
    from fla.ops.delta_rule import wy_fast as delta_wy
    from fla.ops.gated_delta_rule import chunk_fwd
    from fla.ops.gated_delta_rule import wy_fast as gated_wy
    from fla.ops.utils import cumsum
    from fla.ops.utils.index import prepare_chunk_offsets

    return dict(
        kkt_solve=chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel,
        gated_w_u=gated_wy.recompute_w_u_fwd_kernel,
        gated_wy_bwd=gated_wy.prepare_wy_repr_bwd_kernel,
        delta_w_u=delta_wy.recompute_w_u_fwd_kernel,
        delta_wy_bwd=delta_wy.prepare_wy_repr_bwd_kernel,
        fwd_h=chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
        bwd_dhu=chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
        fwd_o=chunk_o.chunk_fwd_kernel_o,
        dv_local=chunk_o.chunk_bwd_kernel_dv_local,
        dqkwg=chunk_o.chunk_bwd_kernel_dqkwg,
        local_cumsum=cumsum.chunk_local_cumsum_scalar_kernel,
        prepare_chunk_offsets=prepare_chunk_offsets,
    )


@functools.cache
def _tile(device_index: int, arch: str) -> int:
    """fla's widest K/V tile for a kernel family on this GPU (its shared-memory classes)."""
    from fla.utils import check_shared_mem

    if arch == "products":  # the output-side backward kernels
        if check_shared_mem("hopper", device_index):
            return 128
        if check_shared_mem("ampere", device_index):
            return 128  # every tensor these kernels load is 16-bit here
        return 64 if check_shared_mem("ada", device_index) else 32
    return 64 if check_shared_mem("none", device_index) else 32


def _block(dim: int, device_index: int, arch: str) -> int:
    return min(max(triton.next_power_of_2(dim), 16), _tile(device_index, arch))


def _chunks(T: int, cu_seqlens, chunk_indices) -> int:
    return triton.cdiv(T, CHUNK) if cu_seqlens is None else len(chunk_indices)


def _sequences(k, cu_seqlens) -> int:
    return k.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1


def wy_prepare(k, v, beta, g, cu_seqlens, chunk_indices):
    """``(w, u, A)``: ``A`` from ``wy_solve``, then ``w = A diag(beta) Gamma k`` and
    ``u = A diag(beta) v``; ``g`` the gate's chunk-local cumsum in base 2, or ``None``."""
    A = wy_solve(k, beta, g, cu_seqlens, chunk_indices)
    w, u = gated_w_u(k, v, beta, A, g, cu_seqlens, chunk_indices)
    return w, u, A


def wy_solve(k, beta, g, cu_seqlens, chunk_indices):
    """``A = (I + diag(beta) strict_tril(Gamma * k k^T))^{-1}`` per chunk, ``[B, T, H, 64]``, in one
    kernel (``k k^T`` and the solve)."""
    B, T, H, K = k.shape
    NT = _chunks(T, cu_seqlens, chunk_indices)
    A = torch.zeros(B, T, H, CHUNK, device=k.device, dtype=k.dtype)
    launch(
        kernels()["kkt_solve"],
        (NT, B * H),
        k=k,
        g=g,
        beta=beta,
        A=A,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        H=H,
        HV=H,
        K=K,
        BT=CHUNK,
        BC=16,
    )
    return A


def delta_w_u(k, v, beta, A, cu_seqlens, chunk_indices):
    """DeltaNet's ``(w, u)`` from its saved ``A`` (fla's delta-rule ``recompute_w_u_fwd``)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    w, u = torch.empty_like(k), torch.empty_like(v)
    launch(
        kernels()["delta_w_u"],
        (_chunks(T, cu_seqlens, chunk_indices), B * H),
        k=k,
        v=v,
        beta=beta,
        w=w,
        u=u,
        A=A,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        H=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=_block(K, k.device.index, "none"),
        BV=_block(V, k.device.index, "none"),
    )
    return w, u


def gated_w_u(k, v, beta, A, g, cu_seqlens, chunk_indices):
    """``(w, u)`` from ``A`` (fla's gated ``recompute_w_u_fwd``; ``g`` may be ``None``)."""
    B, T, H, K = k.shape
    w, u = k.new_empty(B, T, H, K), torch.empty_like(v)
    launch(
        kernels()["gated_w_u"],
        (_chunks(T, cu_seqlens, chunk_indices), B * H),
        k=k,
        v=v,
        beta=beta,
        w=w,
        u=u,
        A=A,
        g=g,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=v.shape[-1],
        BT=CHUNK,
        BK=64,
        BV=64,
    )
    return w, u


def _state_kernel(name: str, sequence_heads: int):
    """fla's state-pass kernel ``name``, with its launch setting tuned per bucket of
    ``sequence_heads`` where ``EFLA_STATE_TUNING=1`` (``experimental/tuning.py``)."""
    kernel = kernels()[name]
    if not environment.get("EFLA_STATE_TUNING"):
        return kernel
    from .experimental import tuning  # noqa: PLC0415 (the default path never imports the experiments)

    return tuning.by_sequence_heads(kernel, sequence_heads)


def _chunk_offsets(cu_seqlens):
    return kernels()["prepare_chunk_offsets"](cu_seqlens, CHUNK) if cu_seqlens is not None else None


def state_pass(k, w, u, g, h0, cu_seqlens, chunk_indices, output_final_state=False):
    """The chunk-to-chunk state pass: ``(h, v_new, final state or None)``; ``h`` holds each chunk's
    starting state, ``v_new = u - w h``. With ``EFLA_SPLIT_STATE`` a dense batch's sequences walk
    in pieces side by side (``experimental/split_state.py``)."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    pieces = _pieces(k, V, cu_seqlens)
    if pieces > 1:
        return _split_state().state_pass_in_pieces(k, w, u, g, h0, pieces, output_final_state)
    N = _sequences(k, cu_seqlens)
    NT = _chunks(T, cu_seqlens, chunk_indices)
    h = k.new_empty(B, NT, H, K, V)
    final = k.new_zeros(N, H, K, V, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    launch(
        _state_kernel("fwd_h", N * H),
        lambda meta: (triton.cdiv(V, meta["BV"]) * N * H,),
        k=k,
        v=u,
        w=w,
        v_new=v_new,
        g=g,
        gk=None,
        h=h,
        h0=h0,
        ht=final,
        cu_seqlens=cu_seqlens,
        chunk_offsets=_chunk_offsets(cu_seqlens),
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        STATE_V_FIRST=False,
    )
    return h, v_new, final


def _pieces(k, V: int, cu_seqlens) -> int:
    """How many pieces each sequence of a dense batch walks in (``split_state.pieces_for``); 1 for a
    packed batch and while ``EFLA_SPLIT_STATE`` asks for none."""
    if cu_seqlens is not None or environment.get("EFLA_SPLIT_STATE") <= 1:
        return 1
    return _split_state().pieces_for(*k.shape, V, k.is_cuda)


def _split_state():
    from .experimental import split_state  # noqa: PLC0415 (the default path never imports the experiments)

    return split_state


def state_grads(q, k, w, g, h0, dht, do, dv, scale, cu_seqlens, chunk_indices):
    """The reverse state pass: ``(dh, dh0 or None, dv)``, ``dv`` with the state's part added. With
    ``EFLA_SPLIT_STATE`` a dense batch's sequences walk in pieces side by side, as in ``state_pass``."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    pieces = _pieces(k, V, cu_seqlens)
    if pieces > 1:
        return _split_state().state_grads_in_pieces(q, k, w, g, h0, dht, do, dv, scale, pieces)
    N = _sequences(k, cu_seqlens)
    NT = _chunks(T, cu_seqlens, chunk_indices)
    dh = q.new_empty(B, NT, H, K, V)
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    launch(
        _state_kernel("bwd_dhu", N * H),
        lambda meta: (triton.cdiv(V, meta["BV"]) * N * H,),
        q=q,
        k=k,
        w=w,
        g=g,
        gk=None,
        dht=dht,
        dh0=dh0,
        do=do,
        dh=dh,
        dv=dv,
        dv2=dv2,
        cu_seqlens=cu_seqlens,
        chunk_offsets=_chunk_offsets(cu_seqlens),
        scale=scale,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        STATE_V_FIRST=False,
    )
    return dh, dh0, dv2


def output(q, k, v_new, h, g, scale, cu_seqlens, chunk_indices):
    """``o``: the chunk's own causal part plus the query against the chunk's starting state."""
    B, T, H, K = q.shape
    V = v_new.shape[-1]
    NT = _chunks(T, cu_seqlens, chunk_indices)
    o = torch.empty_like(v_new)
    launch(
        kernels()["fwd_o"],
        lambda meta: (triton.cdiv(V, meta["BV"]) * NT, B * H),
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=g,
        g_gamma=None,
        o=o,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        scale=scale,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        STATE_V_FIRST=False,
    )
    return o


def local_dv(q, k, do, g, scale, cu_seqlens, chunk_indices):
    """The values' gradient within each chunk (before the state's part)."""
    B, T, H, K = k.shape
    V = do.shape[-1]
    dv = torch.empty_like(do)
    launch(
        kernels()["dv_local"],
        (_chunks(T, cu_seqlens, chunk_indices), B * H),
        q=q,
        k=k,
        g=g,
        g_gamma=None,
        A=None,
        do=do,
        dv=dv,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        scale=scale,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=_block(K, k.device.index, "products"),
        BV=_block(V, k.device.index, "products"),
    )
    return dv


def delta_dqkw(q, k, v_new, w, h, do, dh, dv, scale, cu_seqlens, chunk_indices):
    """``(dq, dk, dw)`` of the ungated chunk products (fla's ``chunk_bwd_dqkwg`` without a gate)."""
    B, T, H, K = k.shape
    V = v_new.shape[-1]
    BK = _block(K, k.device.index, "products")
    NK = triton.cdiv(K, BK)
    dq, dk, dw = q.new_empty(B, T, H, K), k.new_empty(B, T, H, K), torch.empty_like(w)
    launch(
        kernels()["dqkwg"],
        (NK * _chunks(T, cu_seqlens, chunk_indices), B * H),
        q=q,
        k=k,
        v=v_new,
        g=None,
        g_gamma=None,
        h=h,
        do=do,
        dh=dh,
        dq=dq,
        dk=dk,
        dw=dw,
        dv=dv,
        dg=None,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        scale=scale,
        B=B,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=BK,
        BV=_block(V, k.device.index, "products"),
        STATE_V_FIRST=False,
    )
    return dq, dk, dw


def delta_wy_grads(k, v, beta, A, dw, du, cu_seqlens, chunk_indices):
    """``(dk, dv, dbeta)`` through DeltaNet's WY form (fla's delta-rule ``prepare_wy_repr_bwd``)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dk, dv, dbeta = torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    launch(
        kernels()["delta_wy_bwd"],
        (_chunks(T, cu_seqlens, chunk_indices), B * H),
        k=k,
        v=v,
        beta=beta,
        A=A,
        dw=dw,
        du=du,
        dk=dk,
        dv=dv,
        dbeta=dbeta,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        H=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=_block(K, k.device.index, "none"),
        BV=_block(V, k.device.index, "none"),
    )
    return dk, dv, dbeta


def gated_wy_grads(k, v, beta, A, g, dw, du, cu_seqlens, chunk_indices):
    """``(dk, dv, dbeta, dg)`` through the gated WY form (fla's gated ``prepare_wy_repr_bwd``)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dk, dv = k.new_empty(B, T, H, K), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    launch(
        kernels()["gated_wy_bwd"],
        (_chunks(T, cu_seqlens, chunk_indices), B * H),
        k=k,
        v=v,
        beta=beta,
        g=g,
        A=A,
        dw=dw,
        du=du,
        dk=dk,
        dv=dv,
        db=dbeta,
        dg=dg,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=_block(K, k.device.index, "none"),
        BV=_block(V, k.device.index, "none"),
    )
    return dk, dv, dbeta, dg


def local_cumsum(g, cu_seqlens, chunk_indices, reverse=False, scale=None):
    """The chunk-local cumulative sum of a ``[B, T, H]`` gate (float32), reversed for gradients."""
    B, T, H = g.shape
    out = torch.empty_like(g, dtype=torch.float32)
    launch(
        kernels()["local_cumsum"],
        (_chunks(T, cu_seqlens, chunk_indices) * B * H,),
        s=g,
        o=out,
        scale=scale,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        T=T,
        B=B,
        H=H,
        BT=CHUNK,
        REVERSE=reverse,
        USE_GRAPH=False,
    )
    return out
