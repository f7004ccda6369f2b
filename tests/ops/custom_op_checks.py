"""Checks of the GPU chunk custom ops (``efla.ops.cuda.custom_ops``), run on the CPU under Triton's
interpreter by ``test_custom_ops.py`` (a subprocess that calls :func:`main`; TRITON_INTERPRET=1 must
be set before Triton compiles anything).

The interpreter computes float32 kernels correctly but not fla's bfloat16 ones (its matrix products
come back wrong), so the numerical checks are float32; bfloat16 inputs are checked for the schema
and the fake (meta) outputs only. Prints one ``name<TAB>value`` line per check.
"""

from __future__ import annotations

import sys

import torch

from tests.layers import fused_checks

RULES = ("efla", "delta_rule", "gated_efla", "gated_delta_rule")
SHAPE = dict(B=1, T=64, H=2, K=16, V=16)  # one full chunk: A's columns are all written


def inputs(dtype, varlen=False, seed=0):
    """q, k, v, g (float32), beta, h0, cu_seqlens; a varlen batch packs two sequences."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, K, V = SHAPE.values()
    q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, V, generator=g)
    k = torch.randn(B, T, H, K, generator=g) * 10 ** (torch.rand(B, T, H, 1, generator=g) - 0.5)
    beta, lg = torch.rand(B, T, H, generator=g), -torch.rand(B, T, H, generator=g)
    cu = torch.tensor([0, 40, T]) if varlen else None
    h0 = torch.randn(2 if varlen else B, H, K, V, generator=g)
    return [x.to(dtype) for x in (q, k, v)] + [lg, beta.to(dtype), h0, cu]


def op_args(rule, xs, q_l2norm, k_l2norm, final_state=True):
    q, k, v, lg, beta, h0, cu = xs
    gated, exact = rule.startswith("gated"), rule.endswith("efla")
    flags = [0.25, exact, final_state, q_l2norm, k_l2norm]
    if gated:
        return torch.ops.efla.chunk_gated_fwd.default, [q, k, v, lg, beta, h0, cu, *flags]
    return torch.ops.efla.chunk_delta_fwd.default, [q, k, v, beta, h0, cu, *flags]


def _leaves(args):
    return [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args]


def opcheck_forward(rule, dtype, varlen, q_l2norm, k_l2norm, final_state) -> int:
    """opcheck of the forward op, and so of its autograd (the backward op) under AOTAutograd; for
    bfloat16 the schema and fake-output checks only. Returns 0 (it raises on a failure)."""
    op, args = op_args(rule, inputs(dtype, varlen), q_l2norm, k_l2norm, final_state)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if dtype == torch.float32:
        utils += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(op, _leaves(args), test_utils=utils)
    return 0


def opcheck_backward(rule, varlen) -> int:
    """opcheck of the backward op on the tensors its forward op saves (q and k normalised in the op)."""
    op, args = op_args(rule, inputs(torch.float32, varlen), True, True)
    q, k, v, *_ = args
    h0, cu = args[-7], args[-6]
    exact = rule.endswith("efla")
    with torch.no_grad():
        out = op(*args)
    do, dht = torch.randn_like(out[0]), torch.randn_like(out[1])
    if rule.startswith("gated"):
        o, ht, A, gcum, c, vp, qn, q_rstd, kn, k_rstd = out
        g, beta = args[3], args[4]
        bwd = torch.ops.efla.chunk_gated_bwd.default
        bwd_args = [
            qn,
            q_rstd,
            kn,
            k_rstd,
            v,
            vp if exact else v,
            g,
            beta,
            c if exact else beta,
            gcum,
            A,
            h0,
            cu,
            do,
            dht,
            0.25,
            exact,
        ]
    else:
        o, ht, A, alpha, qn, q_rstd, kn, k_rstd = out
        beta = args[3]
        bwd = torch.ops.efla.chunk_delta_bwd.default
        bwd_args = [qn, q_rstd, kn, k_rstd, v, beta, alpha if exact else beta, A, h0, cu, do, dht, 0.25, exact]
    torch.library.opcheck(bwd, bwd_args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    return 0


def _forward_and_grads(forward, rule, xs, q_l2norm, k_l2norm, final_state):
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(*xs[2].shape, generator=gen), torch.randn(*xs[5].shape, generator=gen)
    q, k, v, lg, beta, h0, cu = _leaves(xs)
    o, ht = forward(rule, q, k, v, lg, beta, 0.25, h0, final_state, cu, q_l2norm, k_l2norm)
    assert (ht is not None) == final_state
    loss = (o * do.to(o.dtype)).sum() + ((ht * dht.to(ht.dtype)).sum() if final_state else 0)
    grads = torch.autograd.grad(loss, [q, k, v, lg, beta, h0], allow_unused=True)
    return [o] + ([ht] if final_state else []) + [g_ for g_ in grads if g_ is not None]


def custom_op_vs_function(rule, varlen, q_l2norm, k_l2norm, final_state) -> float:
    """Largest relative difference of (o, ht) and every input gradient between the custom ops and the
    eager autograd Functions (EFLA, Gated EFLA, Gated DeltaNet)."""
    from efla.ops.cuda import custom_ops as CO
    from efla.ops.cuda.chunk import eager_chunk_forward

    xs = inputs(torch.float32, varlen)
    got = _forward_and_grads(CO.op_chunk_forward, rule, xs, q_l2norm, k_l2norm, final_state)
    want = _forward_and_grads(eager_chunk_forward, rule, xs, q_l2norm, k_l2norm, final_state)
    assert len(got) == len(want)
    return max(fused_checks.rel(a, b) for a, b in zip(got, want))


def _reference_forward(rule, q, k, v, lg, beta, scale, h0, final_state, cu, q_l2norm, k_l2norm):
    import efla.ops as ops

    gate = [lg] if rule.startswith("gated") else []
    return getattr(ops, f"recurrent_{rule}")(
        q,
        k,
        v,
        *gate,
        beta,
        scale=scale,
        initial_state=h0,
        output_final_state=final_state,
        cu_seqlens=cu,
        use_q_l2norm_in_kernel=q_l2norm,
        use_qk_l2norm_in_kernel=k_l2norm,
    )


def custom_op_vs_reference(rule, varlen, q_l2norm, k_l2norm, final_state) -> float:
    """The same against the float64 per-token scan (DeltaNet's eager path is fla's own function,
    which takes no float32, and the interpreter runs no bfloat16)."""
    from efla.ops.cuda import custom_ops as CO

    xs = inputs(torch.float32, varlen)
    got = _forward_and_grads(CO.op_chunk_forward, rule, xs, q_l2norm, k_l2norm, final_state)
    xs64 = [x.double() if x is not None and x.is_floating_point() else x for x in xs]
    want = _forward_and_grads(_reference_forward, rule, xs64, q_l2norm, k_l2norm, final_state)
    return max(fused_checks.rel(a, b) for a, b in zip(got, want))


def compiled_vs_eager(rule) -> float:
    """``torch.compile(fullgraph=True)`` of the dispatcher's chunk entry (the custom ops then) against
    the custom ops called eagerly, output and gradients; raises on a graph break or a recompilation."""
    from efla.ops.cuda.custom_ops import chunk_forward, op_chunk_forward

    def loss(q, k, v, lg, beta, h0):
        o, ht = chunk_forward(rule, q, k, v, lg, beta, 0.25, h0, True, None, True, rule.endswith("delta_rule"))
        return (o * o).sum() + ht.sum()

    def eager_loss(q, k, v, lg, beta, h0):
        o, ht = op_chunk_forward(rule, q, k, v, lg, beta, 0.25, h0, True, None, True, rule.endswith("delta_rule"))
        return (o * o).sum() + ht.sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False)
    worst = 0.0
    for seed in range(2):  # the second call must reuse the first call's graph
        xs = inputs(torch.float32, seed=seed)[:6]
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = _loss_and_grads(compiled, xs)
        worst = max(worst, *(fused_checks.rel(a, b) for a, b in zip(got, _loss_and_grads(eager_loss, xs))))
    return worst


def _loss_and_grads(fn, xs):
    leaves = _leaves(xs)
    value = fn(*leaves)
    return [value] + [g for g in torch.autograd.grad(value, leaves, allow_unused=True) if g is not None]


def dqkwg_launch_settings_agree() -> float:
    """Our gated backward stage (dq, dk, dw, dg of a chunk) at each launch setting the GPU autotunes
    over, against the first: the largest relative difference."""
    from efla.ops.cuda import chunk
    from efla.ops.cuda import kernels as kn

    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 128, 2, 16, 128  # two chunks; V = 128 takes one or two value blocks
    NT = T // chunk.CHUNK
    q, k = (torch.randn(B, T, H, K, generator=g) for _ in range(2))
    v_new, do, dv = (torch.randn(B, T, H, V, generator=g) for _ in range(3))
    h, dh = (torch.randn(B * NT, H, K, V, generator=g) for _ in range(2))
    gcum = -torch.rand(B, NT, chunk.CHUNK, H, generator=g).cumsum(2).view(B, T, H)
    args = (q, k, v_new, gcum, h, do, dh, dv, 0.25, None, None)
    settings = [dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages) for cfg in kn.DQKWG_CONFIGS]
    first = chunk.gated_dqkwg(*args, launch=settings[0])
    return max(fused_checks.rel(a, b) for launch in settings[1:] for a, b in zip(chunk.gated_dqkwg(*args, launch=launch), first))


# (varlen, q_l2norm, k_l2norm, output_final_state)
CASES = ((False, True, False, True), (True, True, True, True), (False, False, False, False))


def main() -> int:
    fused_checks.prepare_interpreter()
    from efla.ops.cuda import chunk, custom_ops  # noqa: F401 (registers the ops)

    chunk.load()
    for rule in RULES:
        for case in CASES:
            name = "{} varlen={} q_l2norm={} k_l2norm={} final_state={}".format(rule, *case)
            for dtype in (torch.float32, torch.bfloat16):
                print(f"opcheck forward {name} {dtype}\t{opcheck_forward(rule, dtype, *case)}")
            print(f"custom op vs float64 reference {name}\t{custom_op_vs_reference(rule, *case):.3e}")
            if rule != "delta_rule":
                print(f"custom op vs eager {name}\t{custom_op_vs_function(rule, *case):.3e}")
        print(f"opcheck backward {rule}\t{opcheck_backward(rule, varlen=True)}")
        print(f"compiled vs eager {rule}\t{compiled_vs_eager(rule):.3e}")
    print(f"dqkwg launch settings agree\t{dqkwg_launch_settings_agree():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
