"""The chunk-to-chunk state passes over sequences cut into pieces that walk side by side (opt-in:
``EFLA_SPLIT_STATE=<pieces>``).

fla's state pass walks each (sequence, head) through its chunks in order, one program per value
block, and the backward's reverse pass walks them back: at [2, 16384, 16] with K = V = 128 that is
32 sequence-heads walking 256 chunks each, a few dozen programs on the H200's 132 multiprocessors,
so the passes wait on each chunk's latency rather than on memory. Over a piece of a sequence the
state after it is an affine function of the state before it, ``h_out = M h_in + h_local``, and the
state's gradient before it one of the gradient after it. Cut each sequence into chunk-aligned
pieces and:

1. summarise every piece, all pieces at once: forwards with fla's affine pre-scan (its
   context-parallel kernel), backwards with ``gradient_summary_kernel`` here (fla's backward
   pre-scan takes one sequence per launch), ``[h_local | M]`` as ``[K, V + K]`` float32 per head;
2. chain the summaries with fla's merge kernel into the state entering each piece (forwards from
   the sequence's initial state, backwards from the final state's gradient, last piece first);
3. run fla's pass over all pieces at once as a packed batch, each from its entering state.

The pieces hold whole chunks, so the per-chunk states, new values and gradients come out in the
layout of the dense passes. What differs is rounding: the whole pass carries the state in float32
but rounds it to the inputs' dtype as a product's operand at each chunk, where a piece's entering
state comes from chained float32 summaries (fla composes ``M`` in three-pass TF32, the backward's
as two 16-bit parts). The summaries and the merge are work the
whole pass does not do; they pay only where the whole pass leaves the GPU idle, which
``benchmarks/gpu_ops.py`` and ``benchmarks/gpu_stages.py`` measure.

On a GPU: never timed, and never passed a test. Its GPU tests (``tests/ops/test_split_state.py -m
gpu``) ran once, on an H200 on 2026-12-05, and the first two failed, cause unknown: the run was cut
off at its limit before pytest printed why. Only the CPU interpreter's float32 runs have checked it.
Decided at the next GPU visit by
``PYTEST_K=split OPS_ARGS="--skip-decode --skip-model --skip-correctness --rounds 3 --variants
tuned,split4,split8" bash scripts/device.sh optests ops``: the tests pass and three rounds show the
split passes faster than ``tuned`` where the whole pass leaves the GPU idle, and it becomes the
default with that measured dispatch rule, or it is deleted.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from efla import environment

from .. import stages
from ..kernels import autotune_kwargs, tunable
from ..launch import launch

CHUNK = 64


@functools.cache
def _kernels() -> dict:
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_kernel_h
    from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge
    from fla.ops.utils.index import prepare_chunk_indices

    return dict(pre_scan=chunk_cp_fwd_kernel_h, merge=chunk_cp_fwd_bwd_kernel_merge, chunk_indices=prepare_chunk_indices)


def packed(*tensors):
    """Each ``[B, T, ...]`` tensor (or ``None``) as one sequence of ``B * T`` tokens, ``[1, B * T,
    ...]``: the pieces of a dense batch as a packed batch."""
    return [x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]) if x is not None else None for x in tensors]


def chunks_per_piece(T: int, pieces: int) -> int:
    """Whole chunks in each piece of a ``T``-token sequence cut into about ``pieces`` (the last
    piece may hold fewer)."""
    chunks = triton.cdiv(T, CHUNK)
    return triton.cdiv(chunks, max(1, min(pieces, chunks)))


def piece_count(T: int, pieces: int) -> int:
    """How many pieces a ``T``-token sequence is cut into when about ``pieces`` are asked for."""
    return triton.cdiv(triton.cdiv(T, CHUNK), chunks_per_piece(T, pieces)) if T > 0 else 1


def pieces_for(B: int, T: int, H: int, K: int, V: int, on_cuda: bool) -> int:
    """How many pieces each of ``B`` sequences of ``T`` tokens walks in: about ``EFLA_SPLIT_STATE``,
    or 1 where splitting does not apply (off, keys outside 16-128 wide, a GPU older than sm_80 (fla's
    three-pass TF32 products), a CUDA graph being captured (the layout's first use copies to the
    GPU), or summaries past what fla's merge kernel addresses with 32-bit offsets)."""
    asked = environment.get("EFLA_SPLIT_STATE")
    if asked <= 1 or not 16 <= K <= 128:
        return 1
    if on_cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_device_capability()[0] < 8):
        return 1
    pieces = piece_count(T, asked)
    return pieces if B * pieces * H * K * (V + K) < 2**31 else 1


def state_pass_in_pieces(k, w, u, g, h0, pieces: int, output_final_state: bool):
    """``stages.state_pass`` of a dense batch, each sequence walked in ``pieces`` side by side."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    states, boundaries, table = entering_states(k, w, u, g, h0, pieces)
    h, v_new, final = stages.state_pass(*packed(k, w, u, g), states, boundaries, table, output_final_state)
    final = final.view(B, pieces, H, K, V)[:, -1].contiguous() if final is not None else None
    return h.view(B, -1, H, K, V), v_new.view(B, T, H, V), final


def state_grads_in_pieces(q, k, w, g, h0, dht, do, dv, scale, pieces: int):
    """``stages.state_grads`` of a dense batch, each sequence walked back in ``pieces`` side by side."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    arriving, boundaries, table = gradients_from_the_right(q, k, w, g, dht, do, dv, scale, pieces)
    q1, k1, w1, g1, do1, dv1 = packed(q, k, w, g, do, dv)
    per_piece_h0 = arriving if h0 is not None else None  # its shape only: every piece's dh0 is written
    dh, dh0, dv2 = stages.state_grads(q1, k1, w1, g1, per_piece_h0, arriving, do1, dv1, scale, boundaries, table)
    dh0 = dh0.view(B, pieces, H, K, V)[:, 0].contiguous() if dh0 is not None else None
    return dh.view(B, -1, H, K, V), dh0, dv2.view(B, T, H, V)


@functools.lru_cache(maxsize=64)
def _layout(B: int, T: int, pieces: int, device: torch.device):
    """The packed batch of ``B`` sequences of ``T`` tokens, each cut into ``pieces`` (at least two)
    chunk-aligned pieces: ``(boundaries, chunk table, merge offsets, merge outputs' offsets,
    sequence ids)``, on ``device``."""
    span = chunks_per_piece(T, pieces) * CHUNK
    starts = [b * T + i * span for b in range(B) for i in range(pieces)]
    boundaries = torch.tensor([*starts, B * T], dtype=torch.int32, device=device)
    table = _kernels()["chunk_indices"](boundaries, CHUNK)
    seq_offsets = torch.arange(0, B * pieces + 1, pieces, dtype=torch.int32, device=device)
    init_offsets = torch.arange(0, B * (pieces - 1) + 1, pieces - 1, dtype=torch.int32, device=device)
    seq_ids = torch.arange(B, dtype=torch.int32, device=device)
    return boundaries, table, seq_offsets, init_offsets, seq_ids


def entering_states(k, w, u, g, h0, pieces: int):
    """``(states entering every piece [B * pieces, H, K, V] float32, boundaries, chunk table)`` of
    the dense batch ``k``/``w`` ``[B, T, H, K]``, ``u`` ``[B, T, H, V]``, ``g`` the gate's
    chunk-local cumsum in base 2 (or ``None``), ``h0`` ``[B, H, K, V]`` or ``None``, each sequence
    cut into ``pieces`` (``piece_count``, at least two)."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    boundaries, table, seq_offsets, init_offsets, seq_ids = _layout(B, T, pieces, k.device)
    k1, w1, u1, g1 = packed(k, w, u, g)
    summaries = k.new_empty(B * pieces, H, K, V + K, dtype=torch.float32)
    block = 32 if K <= 64 else 64  # fla's pre-scan: its column blocks over [h_local | M]
    launch(
        _kernels()["pre_scan"],
        (triton.cdiv(V, block) + triton.cdiv(K, block), H, B * pieces),
        k=k1,
        v=u1,
        w=w1,
        g=g1,
        gk=None,
        bg=None,
        u=u1,
        hm=summaries,
        cu_seqlens=boundaries,
        T=0,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        BV=block,
        BK=triton.next_power_of_2(K),
        MULTI_SEQS=True,
    )
    states = k.new_zeros(B, pieces, H, K, V, dtype=torch.float32)
    if h0 is not None:
        states[:, 0] = h0
    states[:, 1:] = _merge(summaries, h0, B, pieces, seq_offsets, init_offsets, seq_ids).view(B, pieces - 1, H, K, V)
    return states.view(B * pieces, H, K, V), boundaries, table


def _merge(summaries, entering, B, pieces, seq_offsets, init_offsets, seq_ids):
    """fla's merge: each sequence's summaries chained first to last from its ``entering`` state
    (``None``: zeros); the state after each but the last, ``[B * (pieces - 1), H, K, V]``."""
    _, H, K, VK = summaries.shape
    V = VK - K
    chained = summaries.new_empty(B * (pieces - 1), H, K, V)
    launch(
        _kernels()["merge"],
        lambda meta: (triton.cdiv(V, meta["BV"]), B, H),
        h=chained,
        ag_hm=summaries,
        num_ranks=0,
        rank=0,
        seq_offsets=seq_offsets,
        init_offsets=init_offsets,
        h0_seq_ids=seq_ids,
        h0=entering,
        h_seq_idx=None,
        HV=H,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        FORWARD=True,
        IS_INTRACARD=True,
        N=B,
    )
    return chained


# ------------------------------------------------------------------ the backward's state-gradient pass
# fla's reverse pass carries the gradient D of the state from a chunk's end to its start:
#     dv2_t = e_t * (k_t D) + dv_t        (e_t = gamma_t / Gamma_t by row, ones without a gate)
#     D    <- gamma_t D + scale (Gamma_t q_t)^T do_t - w_t^T dv2_t
# affine in D: D_start = M D_end + D_local over a piece, M = prod_t (gamma_t I - w_t^T diag(e_t) k_t).
# fla's pre-scan for it handles one sequence per launch; this one handles every piece at once.


# Triton's type of each argument as the backward passes it (bf16 inputs, float32 gate), to compile the
# kernel ahead of time without a GPU (the sm_90 compile test)
GRADIENT_SUMMARY_ARGUMENT_TYPES = {
    "q": "*bf16",
    "k": "*bf16",
    "w": "*bf16",
    "g": "*fp32",
    "do": "*bf16",
    "dv": "*bf16",
    "summaries": "*fp32",
    "cu_seqlens": "*i32",
    "scale": "fp32",
    "pieces": "i32",
}


@triton.heuristics({"USE_G": lambda args: args["g"] is not None})
@triton.autotune(
    configs=tunable([triton.Config({}, num_warps=warps, num_stages=stages) for warps in (4, 8) for stages in (2, 3, 1)]),
    key=["H", "K", "V", "BT", "USE_G"],
    **autotune_kwargs(),
)
@triton.jit(do_not_specialize=["scale", "pieces"])
def gradient_summary_kernel(
    q,
    k,
    w,
    g,
    do,
    dv,
    summaries,
    cu_seqlens,
    scale,
    pieces,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    USE_G: tl.constexpr,
):
    """Each piece's ``[D_local | M]`` (``[K, V + K]`` per head, float32), each sequence's pieces
    stored last first (the order the merge chains them in): a program holds one block of columns of
    either part and walks the piece's chunks last to first."""
    i_c, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_stored = i_n + pieces - 1 - 2 * (i_n % pieces)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    NV = tl.cdiv(V, BV)
    out = summaries + (i_stored * H + i_h) * K * (V + K)
    if i_c < NV:  # D_local: the gradient at the piece's start when none comes in at its end
        o_v = i_c * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_d = tl.zeros([BK, BV], dtype=tl.float32)
        for i_t in range(tl.cdiv(T, BT) - 1, -1, -1):
            b_k, b_w, b_q, e, gamma, rows, m_t = _chunk(q, k, w, g, bos, T, i_t, i_h, o_k, m_k, H, K, BT, USE_G)
            p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_dv = tl.dot(b_k, b_d.to(b_k.dtype)) * e[:, None] + tl.load(dv + p_v, mask=m_tv, other=0.0).to(tl.float32)
            b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
            b_d = b_d * gamma + tl.dot(tl.trans(b_q), b_do.to(b_q.dtype)) * scale
            b_d -= tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype))
        tl.store(out + o_k[:, None] * (V + K) + o_v[None, :], b_d, mask=m_k[:, None] & m_v[None, :])
    else:  # M, a block of its columns, from the identity's
        o_j = (i_c - NV) * BM + tl.arange(0, BM)
        b_m = tl.where(o_k[:, None] == o_j[None, :], 1.0, 0.0)
        for i_t in range(tl.cdiv(T, BT) - 1, -1, -1):
            b_k, b_w, b_q, e, gamma, rows, m_t = _chunk(q, k, w, g, bos, T, i_t, i_h, o_k, m_k, H, K, BT, USE_G)
            b_km = _dot_bf16x2(b_k, b_m) * e[:, None]
            b_m = b_m * gamma - _dot_bf16x2(tl.trans(b_w), b_km)
        tl.store(out + V + o_k[:, None] * (V + K) + o_j[None, :], b_m, mask=m_k[:, None] & (o_j < K)[None, :])


@triton.jit
def _dot_bf16x2(a, b):
    """``a @ b`` for 16-bit ``a`` and float32 ``b``, ``b`` as the sum of two 16-bit parts: about
    16 bits of its mantissa kept (the composed transform accumulates over a piece's chunks), at
    the registers of 16-bit products (three-pass TF32 spilled at K = 128)."""
    b_hi = b.to(a.dtype)
    b_lo = (b - b_hi.to(tl.float32)).to(a.dtype)
    return tl.dot(a, b_lo, tl.dot(a, b_hi))


@triton.jit
def _chunk(q, k, w, g, bos, T, i_t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, USE_G: tl.constexpr):
    """One chunk's keys, WY keys and (gate-scaled) queries, ``[BT, BK]``, the rows' factor ``e``
    and the chunk's decay ``gamma``; rows past the piece's end are zero."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    rows = bos + o_t
    p = (rows[:, None] * H + i_h) * K + o_k[None, :]
    m = m_t[:, None] & m_k[None, :]
    b_k, b_w, b_q = tl.load(k + p, mask=m, other=0.0), tl.load(w + p, mask=m, other=0.0), tl.load(q + p, mask=m, other=0.0)
    if USE_G:
        b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        g_last = tl.load(g + (bos + tl.minimum((i_t + 1) * BT, T) - 1) * H + i_h).to(tl.float32)
        e = tl.where(m_t, tl.exp2(g_last - b_g), 0.0)
        b_q = b_q * tl.exp2(b_g)[:, None]
        gamma = tl.exp2(g_last)
    else:
        e = tl.where(m_t, 1.0, 0.0)
        gamma = 1.0
    return b_k, b_w, b_q, e, gamma, rows, m_t


def gradients_from_the_right(q, k, w, g, dht, do, dv, scale, pieces: int):
    """``(the state gradient arriving at the end of every piece [B * pieces, H, K, V] float32,
    boundaries, chunk table)`` for the backward's reverse pass over the dense batch (``dht`` the
    final state's gradient, or ``None``; ``dv`` the values' gradient from within the chunks)."""
    B, T, H, K = k.shape
    V = do.shape[-1]
    boundaries, table, seq_offsets, init_offsets, seq_ids = _layout(B, T, pieces, k.device)
    summaries = k.new_empty(B * pieces, H, K, V + K, dtype=torch.float32)
    block = 32  # columns per program: at K = 128, 64 spilled with 4 warps on sm_90 (32 does not)
    q1, k1, w1, g1, do1, dv1 = packed(q, k, w, g, do, dv)
    launch(
        gradient_summary_kernel,
        (triton.cdiv(V, block) + triton.cdiv(K, block), H, B * pieces),
        q=q1,
        k=k1,
        w=w1,
        g=g1,
        do=do1,
        dv=dv1,
        summaries=summaries,
        cu_seqlens=boundaries,
        scale=scale,
        pieces=pieces,
        H=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=max(triton.next_power_of_2(K), 16),
        BV=block,
        BM=block,
    )
    # fla's merge chains each sequence's summaries first to last from an entering state: here last
    # piece first (as stored), from dht
    chained = _merge(summaries, dht, B, pieces, seq_offsets, init_offsets, seq_ids)
    arriving = k.new_zeros(B, pieces, H, K, V, dtype=torch.float32)
    if dht is not None:
        arriving[:, -1] = dht
    arriving[:, :-1] = chained.view(B, pieces - 1, H, K, V).flip(1)
    return arriving.view(B * pieces, H, K, V), boundaries, table
