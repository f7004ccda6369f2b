"""Raw gate inputs of the gated ops (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``).

* CPU: the op with raw inputs equals the op given the activated ones, values and gradients
  (``A_log`` and ``dt_bias`` included), and the keywords' mistakes are named.
* Triton interpreter (CPU; skips without triton / fla / an old enough NumPy): the coefficient
  kernels activate raw gates in the same pass, against float64 autograd, and the GPU chunk path
  with raw gates against the float64 scan.
* GPU: the Gated EFLA layer, whose chunk op takes the raw gates on CUDA, against the same layer
  activating them itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import efla.ops as ops
from tests.interpreter import interpreter_ready

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GATED = ["gated_efla", "gated_delta_rule"]


def rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def raw_inputs(seed=0, B=2, T=37, H=3, K=8, V=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen) * 2
    v = torch.randn(B, T, H, V, generator=gen)
    a, b = torch.randn(B, T, H, generator=gen) * 2, torch.randn(B, T, H, generator=gen) * 2
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    return [x.to(dtype) for x in (q, k, v, a, b, A_log, dt_bias)]


def activated(a, b, A_log, dt_bias, neg_eigval=False):
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b) * (2.0 if neg_eigval else 1.0)
    return g, beta


@pytest.mark.parametrize("rule", GATED)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_raw_gates_equal_activated_inputs_with_gradients(rule, mode, neg_eigval):
    op = getattr(ops, f"{mode}_{rule}")
    leaves = [x.requires_grad_() for x in raw_inputs()]
    q, k, v, a, b, A_log, dt_bias = leaves
    o, S = op(
        q,
        k,
        v,
        a,
        b,
        output_final_state=True,
        use_q_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=neg_eigval,
    )
    grads = torch.autograd.grad((o * o.detach().sin()).sum() + S.sum(), leaves)

    g, beta = activated(a, b, A_log, dt_bias, neg_eigval)
    o_ref, S_ref = op(q, k, v, g, beta, output_final_state=True, use_q_l2norm_in_kernel=True)
    grads_ref = torch.autograd.grad((o_ref * o_ref.detach().sin()).sum() + S_ref.sum(), leaves)
    assert rel(o, o_ref) < 1e-12 and rel(S, S_ref) < 1e-12
    for name, got, want in zip(["q", "k", "v", "a", "b", "A_log", "dt_bias"], grads, grads_ref):
        assert want.abs().max() > 0, name  # every input reaches the loss
        assert rel(got, want) < 1e-12, name


def test_beta_sigmoid_and_gate_apart_and_no_dt_bias():
    q, k, v, a, b, A_log, _ = raw_inputs(seed=1)
    g, beta = activated(a, b, A_log, torch.zeros_like(A_log))
    o_gate, _ = ops.chunk_gated_efla(q, k, v, a, beta, use_gate_in_kernel=True, A_log=A_log)
    o_beta, _ = ops.chunk_gated_efla(q, k, v, g, b, use_beta_sigmoid_in_kernel=True)
    o_ref, _ = ops.chunk_gated_efla(q, k, v, g, beta)
    assert rel(o_gate, o_ref) < 1e-12 and rel(o_beta, o_ref) < 1e-12


def test_raw_gates_in_float32_match_float64():
    inputs64 = raw_inputs(seed=2)
    outs = []
    for x in (inputs64, [t.float() for t in inputs64]):
        q, k, v, a, b, A_log, dt_bias = x
        outs.append(
            ops.chunk_gated_efla(
                q, k, v, a, b, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True
            )[0]
        )
    assert outs[1].dtype == torch.float32 and rel(outs[1], outs[0]) < 1e-4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_gate_in_kernel=True), "A_log: required with use_gate_in_kernel=True"),
        (dict(A_log=torch.zeros(3)), "A_log, dt_bias: only used with use_gate_in_kernel=True"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(4)), "A_log: expected shape (3,)"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(3, 1)), "dt_bias: expected shape (3,)"),
        (dict(use_gate_in_kernel=True, A_log=[0.0, 0.0, 0.0]), "A_log: expected a floating-point torch.Tensor"),
        (dict(allow_neg_eigval=True), "allow_neg_eigval: only used with use_beta_sigmoid_in_kernel=True"),
    ],
)
def test_gate_keyword_mistakes_are_named(kwargs, message):
    q, k, v, a, b, _, _ = raw_inputs()
    with pytest.raises(ValueError) as e:
        ops.chunk_gated_efla(q, k, v, a, torch.sigmoid(b), **kwargs)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda a: a.to(torch.int64), "g: expected dtype torch.float64 (same as q) or torch.float32, got torch.int64"),
        (lambda a: a.half(), "g: expected dtype torch.float64 (same as q) or torch.float32, got torch.float16"),
    ],
)
def test_raw_gate_dtypes_are_held_to_what_the_kernels_take(bad, message):
    q, k, v, a, b, A_log, dt_bias = raw_inputs()
    with pytest.raises(ValueError) as e:
        ops.chunk_gated_efla(q, k, v, bad(a), b, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert str(e.value) == message


def test_ungated_ops_do_not_take_gate_keywords():
    q, k, v, _, b, A_log, _ = raw_inputs()
    with pytest.raises(TypeError):
        ops.chunk_efla(q, k, v, torch.sigmoid(b), use_gate_in_kernel=True, A_log=A_log)


# ----------------------------------------------------------------------------- Triton interpreter
_READY, _WHY = interpreter_ready()

_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from tests.layers.fused_checks import prepare_interpreter
    prepare_interpreter()
    import efla.ops as ops
    from efla.ops.coefficients import coefficients
    from efla.ops.cuda import chunk as C
    from efla.ops.cuda import custom_ops
    from efla.ops.gates import RawGates, activate
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    gen = torch.Generator().manual_seed(0)

    # 1. the coefficient kernels with raw gates, against float64 autograd through the activations
    B, T, H, K, V = 2, 6, 2, 16, 8
    k = torch.randn(B, T, H, K, generator=gen) * torch.tensor([0.05, 20.0])[None, None, :, None]
    v = torch.randn(B, T, H, V, generator=gen)
    a, b = torch.randn(B, T, H, generator=gen) * 2, torch.randn(B, T, H, generator=gen) * 2
    A_log, dt = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    de, dgl = torch.randn(B, T, H, generator=gen).double(), torch.randn(B, T, H, generator=gen).double()
    dvp = torch.randn(B, T, H, V, generator=gen).double()
    for beta_scale in (1.0, 2.0):
        leaves = [x.double().requires_grad_() for x in (k, b, a, v, A_log, dt)]
        kd, bd, ad, vd, Ad, dtd = leaves
        g64, beta64 = activate(ad, bd, RawGates(Ad, dtd, beta_scale))
        gam, e, w = coefficients("gated_efla", kd, beta64, g64)
        vref = vd * (w / e)[..., None]
        gates = RawGates(A_log, dt, beta_scale)
        c, gl, vp = C.coef_fwd(k, b, g=a, v=v, gates=gates)
        for name, got, want in (("erase", c, e), ("decay", gl, gam), ("value", vp, vref)):
            print("coef fwd", beta_scale, name, rel(got, want.detach()), sep="\\t")
        want = torch.autograd.grad((e * de).sum() + (gam * dgl).sum() + (vref * dvp).sum(), leaves)
        dk = torch.zeros(B, T, H, K)
        got = C.coef_bwd(k, b, de.float(), dk, g=a, v=v, dgl=dgl.float(), dvin=dvp.float(), gates=gates)
        for name, x, y in zip(("k", "beta", "a", "v", "A_log", "dt_bias"), (dk, *got), want):
            print("coef bwd", beta_scale, name, rel(x, y), sep="\\t")

    # ... with strided and expanded parameters (the kernels read flat arrays) ...
    strided = RawGates(torch.stack([A_log, A_log * 0 - 7], 1)[:, 0], torch.full((1,), 0.3).expand(H), 1.0)
    assert not strided.A_log.is_contiguous() and not strided.dt_bias.is_contiguous()
    flat = RawGates(strided.A_log.contiguous(), strided.dt_bias.contiguous(), 1.0)
    for got, want in zip(C.coef_fwd(k, b, g=a, v=v, gates=strided), C.coef_fwd(k, b, g=a, v=v, gates=flat)):
        print("strided parameters", rel(got, want.double()), sep="\t")
    # ... and the softplus accurate where the default initialisation puts a + dt_bias (-9 to -2)
    x = torch.linspace(-14.0, 6.0, 2001).view(1, -1, 1).repeat(1, 1, 2)
    gates0 = RawGates(torch.zeros(2), None, None)
    _, gl, _ = C.coef_fwd(torch.zeros(1, 2001, 2, 4), torch.ones(1, 2001, 2), g=x, v=torch.zeros(1, 2001, 2, 4),
                          gates=gates0)
    want = torch.expm1(-F.softplus(x.double()))
    print("softplus", ((gl.double() - want).abs() / want.abs()).max().item() * 50, sep="\t")  # 2e-6 allowed

    # 2. the GPU chunk path (fla's kernels and ours) with raw gates, against the float64 scan
    B, T, H, K, V = 1, 70, 2, 16, 16
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, h0 = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    a, b = torch.randn(B, T, H, generator=gen), torch.randn(B, T, H, generator=gen)
    A_log, dt = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    w_o, w_s = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)

    def run(dtype, chunk):
        leaves = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, a, b, h0, A_log, dt)]
        qq, kk, vv, aa, bb, hh, AA, tt = leaves
        if chunk:
            o, S = custom_ops.chunk_forward("gated_efla", qq, kk, vv, aa, bb, K ** -0.5, hh, True, None, True, False,
                                            RawGates(AA, tt, 1.0))
        else:
            g, beta = activate(aa, bb, RawGates(AA, tt, 1.0))
            o, S = ops.recurrent_gated_efla(qq, kk, vv, g, beta, initial_state=hh, output_final_state=True,
                                            use_q_l2norm_in_kernel=True)
        ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
        return [o, S] + [x.grad for x in leaves]

    names = ["o", "S", "q", "k", "v", "a", "b", "h0", "A_log", "dt_bias"]
    for name, got, want in zip(names, run(torch.float32, True), run(torch.float64, False)):
        print("chunk", name, rel(got, want), sep="\\t")
    """
)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_raw_gates_in_the_gpu_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    errors = [line.split("\t") for line in r.stdout.strip().splitlines() if "\t" in line]
    assert len(errors) == 2 * 3 + 2 * 6 + 3 + 1 + 10, r.stdout
    for *name, err in errors:
        assert float(err) < 1e-4, (name, err)


# ----------------------------------------------------------------------------- GPU
CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (GPU fast path)")
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_gated_efla_layer_raw_gates_on_gpu(neg_eigval, monkeypatch):
    from efla.layers import GatedEFLA

    torch.manual_seed(0)
    layer = GatedEFLA(hidden_size=256, head_dim=64, num_heads=4, expand_v=1, allow_neg_eigval=neg_eigval)
    layer = layer.cuda().to(torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    assert layer._gates_in_op(x, recurrent=False)

    def step():
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        o = layer(leaf)[0]
        (o.float() * torch.linspace(-1, 1, o.numel(), device="cuda").view_as(o)).sum().backward()
        return [o, leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    fused = step()
    monkeypatch.setattr(GatedEFLA, "_gates_in_op", lambda *args, **kwargs: False)
    plain = step()
    names = ["o", "x"] + [n for n, _ in layer.named_parameters()]
    for name, got, want in zip(names, fused, plain):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) < 2e-2, (name, rel(got, want))
