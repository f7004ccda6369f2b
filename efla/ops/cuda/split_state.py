"""The chunk-to-chunk state pass over sequences cut into pieces that walk side by side (opt-in:
``EFLA_SPLIT_STATE=<pieces>``).

fla's state pass walks each (sequence, head) through its chunks in order, one program per value
block: at [2, 16384, 16] with K = V = 128 that is 32 sequence-heads walking 256 chunks each, a few
dozen programs on the H200's 132 multiprocessors, so the pass waits on each chunk's latency rather
than on memory. The state after a piece of a sequence is an affine function of the state before
it, ``h_out = M h_in + h_local``. Cut each sequence into chunk-aligned pieces and:

1. fla's affine pre-scan (its context-parallel kernel) writes every piece's ``[h_local | M]``
   (``[K, V + K]`` per head, float32), all pieces at once;
2. fla's merge kernel chains them into the state entering each piece, from the sequence's initial
   state;
3. fla's state pass walks all pieces at once, each from its entering state, as a packed batch.

The pieces hold whole chunks, so the per-chunk states ``h`` and the new values ``v_new`` come out in
the layout of the dense pass. What differs is rounding: the serial pass rounds the state it carries
to the inputs' dtype at each chunk, the chained summaries carry it in float32 (fla composes ``M``
in three-pass TF32). The pre-scan and the merge cost work that the serial pass does not do; it pays
only where the serial pass leaves the GPU idle, which ``benchmarks/gpu_ops.py`` measures.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .launch import launch

CHUNK = 64


def split_pieces() -> int:
    """``EFLA_SPLIT_STATE``: pieces per sequence for the state pass (``0`` or ``1``: not split,
    the default)."""
    text = os.environ.get("EFLA_SPLIT_STATE", "0")
    if not text.isdigit():
        raise ValueError(f"EFLA_SPLIT_STATE: expected a number of pieces per sequence, got {text!r}")
    return int(text)


@functools.cache
def _kernels() -> dict:
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_kernel_h
    from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge
    from fla.ops.utils.index import prepare_chunk_indices

    return dict(pre_scan=chunk_cp_fwd_kernel_h, merge=chunk_cp_fwd_bwd_kernel_merge, chunk_indices=prepare_chunk_indices)


def chunks_per_piece(T: int, pieces: int) -> int:
    """Whole chunks in each piece of a ``T``-token sequence cut into about ``pieces`` (the last
    piece may hold fewer)."""
    chunks = triton.cdiv(T, CHUNK)
    return triton.cdiv(chunks, max(1, min(pieces, chunks)))


def piece_count(T: int, pieces: int) -> int:
    """How many pieces a ``T``-token sequence is cut into when about ``pieces`` are asked for."""
    return triton.cdiv(triton.cdiv(T, CHUNK), chunks_per_piece(T, pieces))


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
    packed = [x.reshape(1, B * T, *x.shape[2:]) if x is not None else None for x in (k, w, u, g)]
    summaries = k.new_empty(B * pieces, H, K, V + K, dtype=torch.float32)
    block = 32 if K <= 64 else 64  # fla's pre-scan: its column blocks over [h_local | M]
    launch(
        _kernels()["pre_scan"],
        (triton.cdiv(V, block) + triton.cdiv(K, block), H, B * pieces),
        k=packed[0],
        v=packed[2],
        w=packed[1],
        g=packed[3],
        gk=None,
        bg=None,
        u=packed[2],
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
    later = states.new_empty(B * (pieces - 1), H, K, V)
    launch(
        _kernels()["merge"],
        lambda meta: (triton.cdiv(V, meta["BV"]), B, H),
        h=later,
        ag_hm=summaries,
        num_ranks=0,
        rank=0,
        seq_offsets=seq_offsets,
        init_offsets=init_offsets,
        h0_seq_ids=seq_ids,
        h0=h0,
        h_seq_idx=None,
        HV=H,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        FORWARD=True,
        IS_INTRACARD=True,
        N=B,
    )
    states[:, 1:] = later.view(B, pieces - 1, H, K, V)
    return states.view(B * pieces, H, K, V), boundaries, table
