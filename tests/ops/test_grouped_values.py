"""Grouped values: v, beta, g and the states carry HV = groups * H heads, q and k carry H.

Value head i reads query/key head i // groups (flash-linear-attention's order). Every rule is
checked in float64 against the per-token loops of efla.ops.naive with HV heads and against the same op with q
and k repeated per group, forward and backward, in both modes, with states and varlen.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import efla.ops as ops
from efla.ops import api
from efla.ops import naive
from tests.interpreter import interpreter_ready

RULES = ["efla", "gated_efla", "delta_rule", "gated_delta_rule"]
MODES = ["chunk", "recurrent"]
F64 = torch.float64
H, K, V = 2, 5, 3


def grouped_inputs(rule, groups, B=2, T=19, seed=0):
    """q, k [B, T, H, K]; v [B, T, HV, V]; beta, g [B, T, HV]; h0 [B, HV, K, V] (float64 leaves)."""
    HV = groups * H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 1.5
    if "delta" in rule:  # the Euler steps stay contractive on unit keys
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    g = -torch.rand(B, T, HV, generator=gen, dtype=F64) * 0.5
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=F64)
    return [x.requires_grad_() for x in (q, k, v, beta, g, h0)]


def call(mode, rule, q, k, v, beta, g, h0, cu_seqlens=None):
    fn = getattr(ops, f"{mode}_{rule}")
    gates = (g,) if rule.startswith("gated") else ()
    return fn(q, k, v, *gates, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)


def reference(rule, q, k, v, beta, g, initial_state):
    gate = (g,) if rule.startswith("gated") else ()
    return getattr(naive, rule)(q, k, v, *gate, beta, initial_state=initial_state, output_final_state=True)


def leaves_of(rule, inputs):
    q, k, v, beta, g, h0 = inputs
    return [q, k, v, beta, h0] + ([g] if rule.startswith("gated") else [])


def projected_loss(o, S):
    """A scalar that depends on every output and state entry with distinct weights."""
    w_o = torch.linspace(-1.0, 2.0, o.numel(), dtype=o.dtype, device=o.device).view_as(o)
    w_s = torch.linspace(1.5, -0.5, S.numel(), dtype=S.dtype, device=S.device).view_as(S)
    return (o * w_o).sum() + (S * w_s).sum()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
def test_grouped_op_matches_reference(rule, mode, groups):
    inputs = grouped_inputs(rule, groups, seed=groups)
    q, k, v, beta, g, h0 = inputs
    o, S = call(mode, rule, *inputs)
    o_ref, S_ref = reference(rule, q, k, v, beta, g, initial_state=h0)
    assert o.shape == (2, 19, groups * H, V) and S.shape == (2, groups * H, K, V)
    assert rel(o, o_ref) < 1e-10 and rel(S, S_ref) < 1e-10
    leaves = leaves_of(rule, inputs)
    got = torch.autograd.grad(projected_loss(o, S), leaves)
    want = torch.autograd.grad(projected_loss(o_ref, S_ref), leaves)
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state", "g"], got, want):
        assert a.shape == b.shape and rel(a, b) < 1e-10, (name, rel(a, b))


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", RULES)
def test_grouped_op_equals_op_on_repeated_query_key(rule, mode, groups):
    inputs = grouped_inputs(rule, groups, seed=10 + groups)
    q, k = inputs[0], inputs[1]
    q_rep = q.detach().repeat_interleave(groups, dim=2).requires_grad_()
    k_rep = k.detach().repeat_interleave(groups, dim=2).requires_grad_()
    o, S = call(mode, rule, *inputs)
    o_rep, S_rep = call(mode, rule, q_rep, k_rep, *inputs[2:])
    assert rel(o, o_rep) < 1e-13 and rel(S, S_rep) < 1e-13
    leaves = leaves_of(rule, inputs)
    got = torch.autograd.grad(projected_loss(o, S), leaves)
    want = torch.autograd.grad(projected_loss(o_rep, S_rep), [q_rep, k_rep] + leaves[2:])

    def group_sum(x):  # a shared head's gradient is the sum over the value heads that read it
        B, T = x.shape[:2]
        return x.view(B, T, H, groups, K).sum(3)

    want = [group_sum(want[0]), group_sum(want[1])] + list(want[2:])
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state", "g"], got, want):
        assert rel(a, b) < 1e-12, (name, rel(a, b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_grouped_varlen_matches_reference_per_sequence(rule, mode):
    lens = [6, 0, 13, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    groups, N = 2, len(lens)
    q, k, v, beta, g, _ = grouped_inputs(rule, groups, B=1, T=sum(lens), seed=21)
    h0 = torch.randn(N, groups * H, K, V, dtype=F64, requires_grad=True)
    inputs = [q, k, v, beta, g, h0]
    o, S = call(mode, rule, *inputs, cu_seqlens=cu)
    assert o.shape == v.shape and S.shape == h0.shape
    leaves = leaves_of(rule, inputs)
    got = torch.autograd.grad(projected_loss(o, S), leaves)
    o_ref, S_ref = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:  # an empty sequence keeps its initial state
            S_ref.append(h0[i : i + 1])
            continue
        oi, Si = reference(rule, q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], g[:, s:e], initial_state=h0[i : i + 1])
        o_ref.append(oi)
        S_ref.append(Si)
    o_ref, S_ref = torch.cat(o_ref, 1), torch.cat(S_ref)
    assert rel(o, o_ref) < 1e-10 and rel(S, S_ref) < 1e-10
    want = torch.autograd.grad(projected_loss(o_ref, S_ref), leaves)
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state", "g"], got, want):
        assert rel(a, b) < 1e-10, (name, rel(a, b))


def test_backends_receive_one_query_key_head_per_value_head(monkeypatch):
    """The GPU dispatch and the PyTorch engines get the same [B, T, HV, ...] tensors."""
    seen = []
    compute = api._compute

    def spy(rule, mode, q, k, v, g, beta, *args):
        seen.append((q.shape, k.shape, v.shape, g.shape, beta.shape))
        return compute(rule, mode, q, k, v, g, beta, *args)

    monkeypatch.setattr(api, "_compute", spy)
    q, k, v, beta, g, h0 = grouped_inputs("gated_efla", 3, T=4)
    ops.chunk_gated_efla(q, k, v, g, beta, initial_state=h0)
    assert seen == [((2, 4, 6, K), (2, 4, 6, K), (2, 4, 6, V), (2, 4, 6), (2, 4, 6))]


def good_grouped(HV=4):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(1, 5, H, K, generator=gen),
        k=torch.randn(1, 5, H, K, generator=gen),
        v=torch.randn(1, 5, HV, V, generator=gen),
        g=-torch.rand(1, 5, HV, generator=gen),
        beta=torch.rand(1, 5, HV, generator=gen),
    )


def run_gated(x, mode, **kw):
    return getattr(ops, f"{mode}_gated_efla")(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


@pytest.mark.parametrize("mode", MODES)
def test_value_heads_not_a_multiple_of_query_key_heads_are_refused(mode):
    x = good_grouped(HV=3)
    with pytest.raises(ValueError, match=r"^v: expected a number of value heads HV that is a multiple of the 2 "):
        run_gated(x, mode)
    x = good_grouped(HV=1)
    with pytest.raises(ValueError, match=r"^v: .*multiple of the 2 query/key heads"):
        ops.chunk_efla(x["q"], x["k"], x["v"], x["beta"])


@pytest.mark.parametrize("name", ["beta", "g"])
def test_per_head_inputs_must_follow_the_value_heads(name):
    x = good_grouped()
    x[name] = x[name][..., :H]  # one per q/k head instead of one per value head
    with pytest.raises(ValueError, match=rf"^{name}: expected shape \(1, 5, 4\) = \[B, T, HV\]"):
        run_gated(x, "chunk")


def test_initial_state_must_have_one_state_per_value_head():
    x = good_grouped()
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \(1, 4, 5, 3\) = \[N, HV, K, V\]"):
        run_gated(x, "recurrent", initial_state=torch.zeros(1, H, K, V))


# ----------------------------------------------------------------------------- GPU fast path
def gpu_inputs(rule, B, T, N, groups=2, K=64, V=64, seed=3):
    """float32 CPU inputs with HV = groups * H value heads; stiff keys for the exact rules."""
    HV = groups * H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen) / K**0.5
    if rule.endswith("efla"):  # ||k||^2 log-uniform in [1e-2, 1e4]
        k = k * 10 ** (torch.rand(B, T, H, 1, generator=gen) * 3 - 1)
    else:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    g = torch.nn.functional.logsigmoid(2 + 3 * torch.randn(B, T, HV, generator=gen))
    h0 = 0.5 * torch.randn(N, HV, K, V, generator=gen)
    return q, k, v, beta, g, h0


def norm_rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")
@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_grouped_values_match_reference(rule, varlen):
    """bf16 GPU chunk (with grads) and recurrent (no grad) with HV = 2H vs the float64 CPU scan."""
    B, T, cu = (1, 150, [0, 37, 38, 150]) if varlen else (2, 100, None)
    N = B if cu is None else len(cu) - 1
    xs = gpu_inputs(rule, B, T, N)
    dev = [x.cuda().to(torch.bfloat16) for x in xs[:5]] + [xs[5].cuda()]
    ref_in = [x.cpu().double().requires_grad_() for x in dev]
    cu_cpu = torch.tensor(cu) if cu else None
    ro, rS = call("recurrent", rule, *ref_in, cu_seqlens=cu_cpu)
    ref_grads = torch.autograd.grad(projected_loss(ro, rS), leaves_of(rule, ref_in))

    gin = [x.detach().clone().requires_grad_() for x in dev]
    cu_gpu = cu_cpu.cuda().int() if cu else None
    o, S = call("chunk", rule, *gin, cu_seqlens=cu_gpu)
    assert o.dtype == torch.bfloat16 and o.shape == (B, T, 2 * H, 64) and S.shape == (N, 2 * H, 64, 64)
    grads = torch.autograd.grad(projected_loss(o.float(), S), leaves_of(rule, gin))
    assert norm_rel(o, ro) < 2e-2 and norm_rel(S, rS) < 2e-2
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state", "g"], grads, ref_grads):
        assert norm_rel(a, b) < 2e-2, name
    with torch.no_grad():
        o2, S2 = call("recurrent", rule, *[x.detach() for x in dev], cu_seqlens=cu_gpu)
    assert norm_rel(o2, ro) < 2e-2 and norm_rel(S2, rS) < 2e-2


# ----------------------------------------------------------------------------- Triton interpreter (CPU)
_READY, _WHY = interpreter_ready()
REPO = pathlib.Path(__file__).resolve().parent.parent.parent

# 1. flash-linear-attention's own grouped kernel (value head i reads q/k head i // (HV // H))
#    against our grouped op: the head order that converted checkpoints rely on.
# 2. The GPU chunk path (efla/ops/cuda/chunk.py) on the per-value-head q/k that the op hands it.
# Both forward and backward, float32 kernels against the float64 PyTorch scan.
_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.layers.fused_checks import prepare_interpreter
    prepare_interpreter()
    import efla.ops as ops
    from efla.ops.api import expand_query_key_heads
    from efla.ops.cuda import custom_ops as C
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 1, 70, 2, 4, 16, 16
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, h0 = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    beta, lg = torch.rand(B, T, HV, generator=gen), -torch.rand(B, T, HV, generator=gen)
    w_o, w_s = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()

    def run(fn, dtype, q_l2, k_l2):
        leaves = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, lg, beta, h0)]
        o, S = fn(*leaves, q_l2, k_l2)
        ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
        return [o, S] + [x.grad for x in leaves]

    def ours(rule):
        def fn(q, k, v, lg, beta, h0, q_l2, k_l2):
            return getattr(ops, "recurrent_" + rule)(q, k, v, lg, beta, initial_state=h0, output_final_state=True,
                                                      use_q_l2norm_in_kernel=q_l2, use_qk_l2norm_in_kernel=k_l2)
        return fn

    def fla(q, k, v, lg, beta, h0, q_l2, k_l2):
        return fla_chunk_gated_delta_rule(q, k, v, lg, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=k_l2)

    def gpu_chunk(kind):
        def fn(q, k, v, lg, beta, h0, q_l2, k_l2):
            qe, ke = expand_query_key_heads(q, k, HV // H)
            return C.chunk_forward(kind, qe, ke, v, lg, beta, K ** -0.5, h0, True, None, q_l2, k_l2)
        return fn

    cases = [("fla gated_delta_rule", fla, "gated_delta_rule", True, True),
             ("gpu chunk gated_efla", gpu_chunk("gated_efla"), "gated_efla", True, False),
             ("gpu chunk gated_delta_rule", gpu_chunk("gated_delta_rule"), "gated_delta_rule", True, True)]
    for name, fn, rule, q_l2, k_l2 in cases:
        got, want = run(fn, torch.float32, q_l2, k_l2), run(ours(rule), torch.float64, q_l2, k_l2)
        print(name, max(rel(a, b) for a, b in zip(got, want)), sep="\t")
    """
)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_grouped_values_match_fla_and_the_gpu_chunk_path_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    errors = dict(line.split("\t") for line in r.stdout.strip().splitlines() if "\t" in line)
    assert len(errors) == 3, r.stdout
    for name, err in errors.items():
        assert float(err) < 1e-4, (name, err)
