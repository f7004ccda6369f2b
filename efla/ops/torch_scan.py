"""Per-token scan of the generic recurrence (see ``coefficients.py``), any device.

    p_t = S_{t-1}^T k_t                 (what the state predicts for k_t)
    r_t = w_t v_t - d_t a_t p_t         (the correction written back)
    S_t = d_t S_{t-1} + k_t r_t^T       (= d_t (I - a_t k k^T) S_{t-1} + w_t k v^T)
    o_t = S_t^T q_t                     (q already carries the scale)

Forward keeps only every ``SEGMENT``-th state; the backward is a reverse-time scan that
recomputes one segment of states at a time, so memory is O(T (K + V) + (T / SEGMENT) K V)
and no autograd graph is built through the T Python steps. Only the strictly sequential
matrix products run per token; read-outs and gradient contractions are batched per segment.
"""

from __future__ import annotations

import torch

SEGMENT = 64


def _scan_segment(S, k, wv, e, d, states):
    """Advance ``S`` [N, K, V] through one segment, writing S_t into ``states[t + 1]``.

    k [L, N, K]; wv = w v [L, N, V]; e = d a [L, N]; d [L, N] or None;
    ``states`` [L + 1, N, K, V] with ``states[0] = S`` already set. Returns r [L, N, V].
    """
    r = torch.empty_like(wv)
    # all per-step views made up front (one unbind each instead of indexing in the loop)
    kcol = k.unsqueeze(-1).unbind(0)  # [N, K, 1] each
    krow = k.unsqueeze(-2).unbind(0)  # [N, 1, K]
    r_row = r.unsqueeze(-2).unbind(0)  # [N, 1, V]
    neg_e = (-e).unsqueeze(-1).unsqueeze(-1).unbind(0)  # [N, 1, 1]
    wv_row = wv.unsqueeze(-2).unbind(0)
    out = states[1:].unbind(0)
    dd = None if d is None else d[:, :, None, None].unbind(0)
    for t in range(len(kcol)):
        # p = S^T k ; r = wv - e p ; S = d S + k r^T
        rt = r_row[t]
        torch.bmm(krow[t], S, out=rt)
        torch.addcmul(wv_row[t], neg_e[t], rt, out=rt)
        if dd is not None:
            S = S * dd[t]
        S = torch.addcmul(S, kcol[t], rt, out=out[t])  # outer product, cheaper than baddbmm
    return r


class _RecurrentFn(torch.autograd.Function):
    """Time-major inputs in the compute dtype: q, k [T, N, K]; v [T, N, V]; a, w, gamma [T, N]."""

    @staticmethod
    def forward(ctx, q, k, v, gamma, a, w, h0):
        T, N, K = k.shape
        V = v.shape[-1]
        d = None if gamma is None else torch.exp(gamma)
        e = a if d is None else d * a
        wv = w.unsqueeze(-1) * v
        o = torch.empty_like(v)
        buf = h0.new_empty(min(T, SEGMENT) + 1, N, K, V)
        checkpoints = h0.new_empty((T + SEGMENT - 1) // SEGMENT, N, K, V)
        S = h0
        for si, t0 in enumerate(range(0, T, SEGMENT)):
            t1 = min(T, t0 + SEGMENT)
            checkpoints[si] = S
            buf[0] = S
            _scan_segment(S, k[t0:t1], wv[t0:t1], e[t0:t1], None if d is None else d[t0:t1], buf)
            L = t1 - t0
            o[t0:t1] = torch.einsum("lnkv,lnk->lnv", buf[1 : L + 1], q[t0:t1])
            S = buf[L].clone()
        ctx.save_for_backward(q, k, v, gamma, a, w, checkpoints)
        ctx.gated = gamma is not None
        return o, S

    @staticmethod
    def backward(ctx, do, dST):
        q, k, v, gamma, a, w, checkpoints = ctx.saved_tensors
        if not ctx.gated:
            gamma = None
        T, N, K = k.shape
        V = v.shape[-1]
        d = None if gamma is None else torch.exp(gamma)
        e = a if d is None else d * a
        wv = w.unsqueeze(-1) * v
        if do is None:
            do = torch.zeros_like(v)
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dr_all = torch.empty_like(v)
        dd = None if d is None else torch.empty_like(d)
        dS = torch.zeros_like(checkpoints[0]) if dST is None else dST.clone()
        L0 = min(T, SEGMENT)
        buf = checkpoints.new_empty(L0 + 1, N, K, V)  # S_{t0-1} .. S_{t1-1}
        dbuf = checkpoints.new_empty(L0, N, K, V)  # total gradient w.r.t. each S_t
        # per-step views made once (unbind) rather than by indexing inside the loop
        qcol, do_row = q.unsqueeze(-1).unbind(0), do.unsqueeze(-2).unbind(0)
        krow = k.unsqueeze(-2).unbind(0)
        kcol_neg_e = (k * (-e).unsqueeze(-1)).unsqueeze(-1).unbind(0)  # -e_t k_t as a column
        dr_row = dr_all.unsqueeze(-2).unbind(0)
        d_mat = None if d is None else d[:, :, None, None].unbind(0)
        dbuf_l = dbuf.unbind(0)
        r_all = torch.empty_like(v)
        for si in range(checkpoints.shape[0] - 1, -1, -1):
            t0 = si * SEGMENT
            t1 = min(T, t0 + SEGMENT)
            L = t1 - t0
            buf[0] = checkpoints[si]
            r_all[t0:t1] = _scan_segment(checkpoints[si], k[t0:t1], wv[t0:t1], e[t0:t1], None if d is None else d[t0:t1], buf)
            for j in range(L - 1, -1, -1):
                t = t0 + j
                # read-out o_t = S_t^T q_t adds q do^T; then back through S_t = d S + k r^T
                dS = torch.addcmul(dS, qcol[t], do_row[t], out=dbuf_l[j])
                torch.bmm(krow[t], dS, out=dr_row[t])  # dr_t = dS_t^T k_t
                if d_mat is not None:
                    dS = dS * d_mat[t]
                # through p_t = S_{t-1}^T k_t with dp = -e dr
                dS = torch.addcmul(dS, kcol_neg_e[t], dr_row[t])
            S_prev, S_cur = buf[:L], buf[1 : L + 1]
            dSs = dbuf[:L]
            sl = slice(t0, t1)
            dq[sl] = torch.einsum("lnkv,lnv->lnk", S_cur, do[sl])
            dp = -e[sl].unsqueeze(-1) * dr_all[sl]
            dk[sl] = torch.einsum("lnkv,lnv->lnk", dSs, r_all[sl]) + torch.einsum("lnkv,lnv->lnk", S_prev, dp)
            if dd is not None:
                dd[sl] = (dSs * S_prev).sum((-1, -2))
            # p for de: p = S_{t-1}^T k
            p = torch.einsum("lnkv,lnk->lnv", S_prev, k[sl])
            r_all[sl] = p  # reuse the buffer: now holds p
        dr = dr_all
        dv = w.unsqueeze(-1) * dr
        dw = (dr * v).sum(-1)
        de = -(dr * r_all).sum(-1)
        if d is None:
            da, dgamma = de, None
        else:
            da = de * d
            dgamma = (dd + de * a) * d  # e = d a and S_t = d S_{t-1} + ...; d(d)/d(gamma) = d
        return dq, dk, dv, dgamma, da, dw, dS


def recurrent_generic(q, k, v, gamma, a, w, h0):
    """Run the scan on time-major inputs: q, k [T, N, K], v [T, N, V], gamma/a/w [T, N],
    h0 [N, K, V] (all in the compute dtype). Returns (o [T, N, V], final state [N, K, V])."""
    return _RecurrentFn.apply(q, k, v, gamma, a, w, h0)
