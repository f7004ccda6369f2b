"""Chunkwise WY/UT form of the generic recurrence, pure PyTorch, any device.

Per chunk of C tokens with in-chunk cumulative log-decay ``G_t`` (``Gam_t = exp(G_t)``) and
start state ``S``, the corrections ``r_t`` of ``torch_scan.py`` solve a unit lower-triangular
system:

    (I + L) R = diag(w) V - diag(a Gam) K S,   L_ts = a_t exp(G_t - G_s) k_t.k_s  (s < t)

so with ``U = (I + L)^{-1} diag(w) V`` and ``W = (I + L)^{-1} diag(a Gam) K``:

    R      = U - W S
    O      = (Q Gam) S + (Q K^T (.) exp(G_t - G_s) (.) causal) R
    S_next = Gam_C S + (K exp(G_C - G_t))^T R

Everything but the chunk-to-chunk recursion is batched over all chunks and differentiated by
autograd; the recursion itself (two matmuls per chunk) is a ``torch.autograd.Function`` with a
hand-written reverse scan, so only one K x V state per chunk is ever stored.
"""

from __future__ import annotations

import torch

CHUNK = 64


class _UnitLowerInverse(torch.autograd.Function):
    """``(I + L)^{-1}`` for strictly lower-triangular ``L [..., C, C]``, batched over all chunks (a
    per-matrix LAPACK loop was the slowest part): the diagonal blocks of 8 rows by forward
    substitution, then pairs of blocks merged by block substitution (the fixed cost grows with the
    number of steps, 7 + 2 log2(C / 8) instead of C - 1). Backward: ``dL = -strict_tril(T^T dT T^T)``."""

    @staticmethod
    def forward(ctx, L):
        C = L.shape[-1]
        T = _unit_lower_inverse(L.reshape(-1, C, C)).reshape(L.shape)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT):
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return -(Tt @ dT @ Tt).tril(-1)


_SUBSTITUTION_BLOCK = 8


def _substitute(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^{-1}`` of ``L [M, b, b]`` row by row: ``T[i, :i] = -L[i, :i] T[:i, :i]``."""
    b = L.shape[-1]
    T = torch.eye(b, dtype=L.dtype, device=L.device).repeat(L.shape[0], 1, 1)
    for i in range(1, b):
        # a broadcast multiply-sum is several times faster on CPU than bmm on these thin slices
        T[:, i, :i] = -(L[:, i, :i, None] * T[:, :i, :i]).sum(-2)
    return T


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^{-1}`` of ``L [M, C, C]``: blocks of ``b`` rows inverted by substitution, then
    ``[[A, 0], [B, D]]^{-1} = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]`` over pairs of blocks, doubling
    the block size until it covers C (C a power-of-two multiple of the block; else all by substitution)."""
    M, C, _ = L.shape
    b = C
    while b > _SUBSTITUTION_BLOCK and b % 2 == 0:
        b //= 2
    n = C // b
    diagonal = L.reshape(M, n, b, n, b).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [M, n, b, b]
    T = _substitute(diagonal.reshape(M * n, b, b)).reshape(M, n, b, b)
    while n > 1:
        below = L.reshape(M, n, b, n, b).diagonal(offset=-1, dim1=1, dim2=3).permute(0, 3, 1, 2)[:, 0::2]
        upper, lower = T[:, 0::2], T[:, 1::2]
        merged = T.new_zeros(M, n // 2, 2 * b, 2 * b)
        merged[..., :b, :b] = upper
        merged[..., b:, b:] = lower
        merged[..., b:, :b] = -(lower @ below @ upper)
        T, n, b = merged, n // 2, 2 * b
    return T.reshape(M, C, C)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


class _ChunkScan(torch.autograd.Function):
    """R_c = U_c - W_c S_c ;  S_{c+1} = decay_c S_c + Kd_c^T R_c.

    U [N, NC, C, V], W, Kd [N, NC, C, K], decay [N, NC] or None, h0 [N, K, V].
    Returns R [N, NC, C, V], S_starts [N, NC, K, V] (state entering each chunk), S_final.
    """

    @staticmethod
    def forward(ctx, U, W, Kd, decay, h0):
        N, NC, C, V = U.shape
        R = torch.empty_like(U)
        starts = U.new_empty(N, NC, h0.shape[1], V)
        S = h0
        for c in range(NC):
            starts[:, c] = S
            Rc = torch.baddbmm(U[:, c], W[:, c], S, alpha=-1.0)
            R[:, c] = Rc
            if decay is not None:
                S = S * decay[:, c, None, None]
            S = torch.baddbmm(S, Kd[:, c].transpose(1, 2), Rc)
        ctx.save_for_backward(W, Kd, decay, R, starts)
        ctx.gated = decay is not None
        return R, starts, S

    @staticmethod
    def backward(ctx, dR_in, dstarts, dS):
        W, Kd, decay, R, starts = ctx.saved_tensors
        if not ctx.gated:
            decay = None
        N, NC, C, V = R.shape
        dS = torch.zeros_like(starts[:, 0]) if dS is None else dS
        dR = torch.zeros_like(R) if dR_in is None else dR_in.clone()
        dS_next = torch.empty_like(starts)  # gradient w.r.t. the state leaving each chunk
        for c in range(NC - 1, -1, -1):
            dS_next[:, c] = dS
            # S_{c+1} = decay S_c + Kd^T R_c  ->  dR_c += Kd dS_{c+1}
            dRc = torch.baddbmm(dR[:, c], Kd[:, c], dS)
            dR[:, c] = dRc
            # R_c = U_c - W_c S_c  ->  dS_c = decay dS_{c+1} - W^T dR_c (+ direct use of S_c)
            dS = dS if decay is None else dS * decay[:, c, None, None]
            dS = torch.baddbmm(dS, W[:, c].transpose(1, 2), dRc, alpha=-1.0)
            if dstarts is not None:
                dS = dS + dstarts[:, c]
        dU = dR
        dW = -(dR @ starts.transpose(-1, -2))
        dKd = R @ dS_next.transpose(-1, -2)
        ddecay = None if decay is None else _batched_dot(dS_next, starts)
        return dU, dW, dKd, ddecay, dS


def _batched_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(x * y).sum((-1, -2))`` of ``[N, NC, K, V]`` tensors as one batched product (no product
    tensor of the states' size)."""
    N, NC, K, V = x.shape
    return (x.reshape(N * NC, 1, K * V) @ y.reshape(N * NC, K * V, 1)).reshape(N, NC)


def default_chunk_size(K: int, V: int) -> int:
    """64, or 32 for head dims <= 64 (measured faster on CPU: the in-chunk work grows with C,
    the per-chunk overhead with T / C)."""
    return 32 if max(K, V) <= 64 else CHUNK


def chunk_generic(q, k, v, gamma, a, w, h0, chunk_size: int | None = None):
    """Chunkwise form on batch-major inputs: q, k [N, T, K], v [N, T, V], gamma/a/w [N, T]
    (gamma may be None; ``w`` may be ``a`` itself, which saves work), h0 [N, K, V], all in the
    compute dtype.
    Returns (o [N, T, V], final state [N, K, V])."""
    N, T, K = k.shape
    V = v.shape[-1]
    same_factor = w is a  # EFLA and DeltaNet: erase and write are one coefficient
    C = min(chunk_size or default_chunk_size(K, V), T)
    pad = (-T) % C
    if pad:
        # identity steps: k = v = 0 and a = w = 0 leave the state untouched
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        a = torch.nn.functional.pad(a, (0, pad))
        w = a if same_factor else torch.nn.functional.pad(w, (0, pad))
        if gamma is not None:
            gamma = torch.nn.functional.pad(gamma, (0, pad))
    NC = (T + pad) // C
    q = q.reshape(N, NC, C, K)
    k = k.reshape(N, NC, C, K)
    v = v.reshape(N, NC, C, V)
    a = a.reshape(N, NC, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()

    kk = k @ k.transpose(-1, -2)  # [N, NC, C, C]
    qk = q @ k.transpose(-1, -2)
    w = a if same_factor else w.reshape(N, NC, C)
    if gamma is None:
        Lmat = (a[..., :, None] * kk).tril(-1)
        A_qk = qk.tril()
        erase = a
        Kd = k
        decay = None
        Qg = q
    else:
        G = gamma.reshape(N, NC, C).cumsum(-1)  # in-chunk cumulative log decay
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))
        Dm = diff.exp()  # exp(G_t - G_s) for s <= t, 0 above the diagonal
        Lmat = (a[..., :, None] * kk * Dm).tril(-1)
        A_qk = qk * Dm
        Gam = G.exp()
        erase = a * Gam
        Kd = k * (G[..., -1:] - G).exp()[..., None]
        decay = Gam[..., -1]
        Qg = q * Gam[..., None]
    inverse = _UnitLowerInverse.apply(Lmat)
    # the per-token factors scale the inverse's C columns rather than the C x K rows of v and k
    # (half the work at C = 32, K = 64, backward included), once when erase and write are one
    # tensor; two products rather than one over [v | k]: the outputs come out contiguous, and the
    # backward adds two gradients instead of zero-filling a full-width one per slice
    write_inverse = inverse * w[..., None, :]
    erase_inverse = write_inverse if erase is w else inverse * erase[..., None, :]
    U = write_inverse @ v
    W = erase_inverse @ k
    R, starts, S = _ChunkScan.apply(U, W, Kd.contiguous(), decay, h0)
    o = Qg @ starts + A_qk @ R
    if o.requires_grad:
        # a gradient that arrives transposed back from the caller's layout (or expanded, from a sum)
        # would send every batched product of the backward down a per-matrix loop on the CPU: made
        # contiguous once here (a hook, not an identity Function, whose output would be a view that
        # callers could not modify in place)
        o.register_hook(_contiguous)
    o = o.reshape(N, NC * C, V)[:, :T]
    return o, S
