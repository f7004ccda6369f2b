"""The state passes over sequences cut into pieces that walk side by side (``EFLA_SPLIT_STATE``).

Under Triton's CPU interpreter, in float32: the forward state pass in pieces gives the per-chunk
states, new values and final states of the pass that walks each sequence whole, and the backward's
reverse pass in pieces its per-chunk state gradients, initial-state gradient and value gradients
(with and without a gate, an initial state and a final state's gradient, a last chunk that is
partial, more pieces asked for than there are chunks); the EFLA and Gated EFLA chunk ops with both,
forward and backward, match the float64 per-token reference. On a GPU (bf16): the ops with it
against the reference and against the ops without it (the interpreter's float32 inputs leave the
low half of the 16-bit split of the composed transform at zero: only the GPU test covers it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from efla import environment
from efla.ops.cuda.experimental import split_state
from tests.interpreter import interpreter_ready

REPO = Path(__file__).resolve().parents[2]
_OK, _WHY = interpreter_ready()

_SCRIPT = textwrap.dedent(
    """
    import importlib, sys, torch
    sys.path.insert(0, {repo!r})
    from tests.layers import fused_checks
    fused_checks.prepare_interpreter()
    for name in ("fla.ops.cp.chunk_fwd", "fla.ops.cp.chunk_merge"):  # the pre-scan's and the merge's loops
        importlib.import_module(name).range = fused_checks._loop_range
    import efla.ops as ops
    from efla import environment
    from efla.ops.cuda import custom_ops as C, stages as st

    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()

    def state_pass_case(B, T, H, K, V, pieces, gated, with_h0):
        torch.manual_seed(T + K)
        k, w = torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, K) * 0.3
        u = torch.randn(B, T, H, V)
        g = st.local_cumsum(-0.05 * torch.rand(B, T, H), None, None, scale=st.RCP_LN2) if gated else None  # a state that lasts
        h0 = torch.randn(B, H, K, V) if with_h0 else None
        with environment.override(EFLA_SPLIT_STATE=0):
            whole = st.state_pass(k, w, u, g, h0, None, None, True)
        with environment.override(EFLA_SPLIT_STATE=pieces):
            split = st.state_pass(k, w, u, g, h0, None, None, True)
        errors = [rel(a, b) for a, b in zip(split, whole)]
        assert all(a.shape == b.shape for a, b in zip(split, whole))
        assert max(errors) < 1e-5, (B, T, H, K, V, pieces, gated, with_h0, errors)
        return max(errors)

    print(state_pass_case(2, 300, 2, 32, 16, 3, False, False))  # pieces of 2, 2 and 1 chunks, the last partial
    print(state_pass_case(2, 300, 2, 32, 16, 3, True, True))
    print(state_pass_case(1, 256, 2, 64, 32, 2, True, True))  # K = 64: the pre-scan's narrower column blocks
    print(state_pass_case(2, 128, 1, 16, 16, 8, False, True))  # 8 asked for, 2 chunks: 2 pieces

    def state_grads_case(B, T, H, K, V, pieces, gated, with_h0, with_dht):
        torch.manual_seed(T + K + 1)
        q, k, w = (torch.randn(B, T, H, K) * 0.3 for _ in range(3))
        do, dv = torch.randn(B, T, H, V), torch.randn(B, T, H, V)
        g = st.local_cumsum(-0.05 * torch.rand(B, T, H), None, None, scale=st.RCP_LN2) if gated else None
        h0 = torch.randn(B, H, K, V) if with_h0 else None
        dht = torch.randn(B, H, K, V) if with_dht else None
        with environment.override(EFLA_SPLIT_STATE=0):
            whole = st.state_grads(q, k, w, g, h0, dht, do, dv, 0.3, None, None)
        with environment.override(EFLA_SPLIT_STATE=pieces):
            split = st.state_grads(q, k, w, g, h0, dht, do, dv, 0.3, None, None)
        assert (split[1] is None) == (whole[1] is None)
        pairs = [(a, b) for a, b in zip(split, whole) if b is not None]
        assert all(a.shape == b.shape for a, b in pairs)
        errors = [rel(a, b) for a, b in pairs]
        assert max(errors) < 1e-5, (B, T, H, K, V, pieces, gated, with_h0, with_dht, errors)
        return max(errors)

    print(state_grads_case(2, 300, 2, 32, 16, 3, False, True, True))  # dh, dh0 and dv of the reverse pass
    print(state_grads_case(2, 300, 2, 32, 16, 3, True, True, False))
    print(state_grads_case(1, 256, 2, 64, 32, 2, True, False, True))
    print(state_grads_case(2, 128, 1, 16, 16, 8, False, True, True))

    def op_case(kind):
        g = torch.Generator().manual_seed(3)
        B, T, H, K, V = 2, 200, 2, 16, 16
        q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, V, generator=g)
        k = torch.randn(B, T, H, K, generator=g) * 10 ** (torch.rand(B, T, H, 1, generator=g) * 2 - 1)
        beta, lg = torch.rand(B, T, H, generator=g), -torch.rand(B, T, H, generator=g)
        h0, dout = torch.randn(B, H, K, V, generator=g), torch.randn(B, T, H, V, generator=g)
        gated = kind == "gated_efla"
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, lg, h0)]
        with environment.override(EFLA_SPLIT_STATE=2):
            o, ht = C.chunk_forward(kind, leaves[0], leaves[1], leaves[2], leaves[4] if gated else None, leaves[3],
                                    K**-0.5, leaves[5], True, None, True, False)
            ((o * dout).sum() + ht.sum()).backward()
        got = [o, ht] + [x.grad for x in leaves if x.grad is not None]
        ref_leaves = [x.double().clone().requires_grad_() for x in (q, k, v, beta, lg, h0)]
        args = [ops.l2_normalize(ref_leaves[0]), ref_leaves[1], ref_leaves[2]] + ([ref_leaves[4]] if gated else [])
        ro, rt = getattr(ops, "recurrent_" + kind)(*args, ref_leaves[3], scale=K**-0.5, initial_state=ref_leaves[5],
                                                   output_final_state=True)
        ((ro * dout.double()).sum() + rt.sum()).backward()
        ref = [ro, rt] + [x.grad for x in ref_leaves if x.grad is not None]
        assert len(got) == len(ref)
        worst = max(rel(a, b) for a, b in zip(got, ref))
        assert worst < 1e-4, (kind, [rel(a, b) for a, b in zip(got, ref)])
        return worst

    print("efla", op_case("efla"))
    print("gated_efla", op_case("gated_efla"))
    print("OK")
    """
)


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_state_pass_in_pieces_matches_the_whole_pass_and_the_float64_scan_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = _SCRIPT.format(repo=str(REPO))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize(
    "T, asked, pieces, per_piece",
    [(16384, 4, 4, 64), (300, 3, 3, 2), (128, 8, 2, 1), (100, 0, 1, 2), (100, 1, 1, 2), (64 * 9, 4, 3, 3)],
)
def test_pieces_hold_whole_chunks(T, asked, pieces, per_piece):
    assert split_state.piece_count(T, asked) == pieces
    assert split_state.chunks_per_piece(T, asked) == per_piece


@pytest.mark.parametrize(
    "asked, shape, pieces",
    [
        ("4", (2, 16384, 16, 128, 128), 4),
        ("", (2, 16384, 16, 128, 128), 1),  # unset, or set empty: off
        ("1", (2, 16384, 16, 128, 128), 1),
        ("4", (2, 16384, 16, 8, 128), 1),  # keys narrower than a product's 16
        ("4", (2, 16384, 16, 256, 256), 1),  # wider than the gradient summary's 128
        ("4", (2, 0, 16, 128, 128), 1),  # nothing to walk
        ("8", (300, 16384, 32, 128, 128), 1),  # summaries past 32-bit offsets in fla's merge kernel
        ("8", (200, 16384, 32, 128, 128), 8),
    ],
)
def test_splitting_applies_only_where_it_can(asked, shape, pieces, switches):
    switches(EFLA_SPLIT_STATE=asked)
    assert split_state.pieces_for(*shape, on_cuda=False) == pieces


@pytest.mark.parametrize("text", ["yes", "-2", "4.5", "²"])
def test_a_piece_count_that_is_not_a_number_is_refused(text, monkeypatch):
    monkeypatch.setenv("EFLA_SPLIT_STATE", text)
    environment.reload()
    with pytest.raises(ValueError, match="EFLA_SPLIT_STATE"):
        environment.get("EFLA_SPLIT_STATE")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_gpu_split_state_matches_reference_and_the_whole_pass(rule):
    import efla.ops as ops

    torch.manual_seed(2)
    gated = rule == "gated_efla"
    B, T, H, K, V = 2, 1000, 4, 128, 128
    stiff = torch.empty(B, T, H, 1).uniform_(-1, 2).exp2().pow(3.3)
    inputs = [torch.randn(B, T, H, K), torch.randn(B, T, H, K) * stiff, torch.randn(B, T, H, V)]
    inputs += [-torch.rand(B, T, H) * 2] if gated else []
    inputs += [torch.rand(B, T, H)]
    inputs = [x.to("cuda", torch.bfloat16).requires_grad_() for x in inputs]
    h0 = torch.randn(B, H, K, V, device="cuda", requires_grad=True)
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def run(pieces):
        with environment.override(EFLA_SPLIT_STATE=pieces):
            o, S = getattr(ops, "chunk_" + rule)(*inputs, initial_state=h0, output_final_state=True, scale=K**-0.5)
            grads = torch.autograd.grad((o.float() * do.float()).sum() + S.sum(), [*inputs, h0])
        return [o, S, *grads]

    split, whole = run("4"), run("0")
    ref_inputs = [x.detach().double().cpu().requires_grad_() for x in [*inputs, h0]]
    ro, rS = getattr(ops, "recurrent_" + rule)(
        *ref_inputs[:-1], initial_state=ref_inputs[-1], output_final_state=True, scale=K**-0.5
    )
    ref = [ro, rS, *torch.autograd.grad((ro * do.double().cpu()).sum() + rS.sum(), ref_inputs)]
    rel = lambda a, b: ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()  # noqa: E731
    assert max(rel(a, b) for a, b in zip(split, ref)) < 2e-2
    assert max(rel(a, b) for a, b in zip(split, whole)) < 5e-3
