"""The fused GPU modules (flash-linear-attention's kernels behind our modules) compute what the
PyTorch modules compute, forward and backward; the model trains the same through either path.

CUDA tests skip without a GPU. The interpreter test runs the same module checks, and the chunk
ops with the in-op q/k normalisation, on the CPU under ``TRITON_INTERPRET=1``; it skips where
Triton or flash-linear-attention is not installed (CI installs neither) or NumPy is too new for
Triton's interpreter. The CPU tests always run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import efla.ops as ops
from efla.layers import EFLA, GatedEFLA, RMSNorm
from efla.layers import fla_kernels as fused
from efla.models import EFLAForCausalLM, get_preset_config

from . import fused_checks
from tests.interpreter import interpreter_ready

CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """A GPU test: skipped without a CUDA device, selected by ``pytest -m gpu``."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(test))


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_READY, _WHY = interpreter_ready()


# ----------------------------------------------------------------------------- CPU, always
@pytest.mark.parametrize("rule", ["efla", "gated_efla", "delta_rule", "gated_delta_rule"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_in_op_l2norm_equals_normalising_first(rule, mode):
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 37, 2, 8, 4
    q, k = torch.randn(B, T, H, K, generator=g).double(), 3 * torch.randn(B, T, H, K, generator=g).double()
    v, beta = torch.randn(B, T, H, V, generator=g).double(), torch.rand(B, T, H, generator=g).double()
    gate = [-torch.rand(B, T, H, generator=g).double()] if rule.startswith("gated") else []
    fn = getattr(ops, f"{mode}_{rule}")
    for q_only in (True, False):
        kw = {"use_q_l2norm_in_kernel": True} if q_only else {"use_qk_l2norm_in_kernel": True}
        o, _ = fn(q, k, v, *gate, beta, **kw)
        kn = k if q_only else ops.l2_normalize(k)
        ref, _ = fn(ops.l2_normalize(q), kn, v, *gate, beta)
        assert (o - ref).abs().max().item() < 1e-12


def test_gated_ops_take_a_float32_gate_with_bf16_inputs():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 20, 2, 8, generator=g) for _ in range(3))
    beta, gate = torch.rand(1, 20, 2, generator=g), -torch.rand(1, 20, 2, generator=g) * 5
    for rule in ("gated_efla", "gated_delta_rule"):
        fn = getattr(ops, f"chunk_{rule}")
        o16, _ = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, beta.bfloat16())
        o32, _ = fn(q, k, v, gate, beta)
        assert o16.dtype == torch.bfloat16
        assert fused_checks.rel(o16, o32) < 2e-2
    with pytest.raises(ValueError, match="g: expected dtype"):
        ops.chunk_gated_efla(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate.half(), beta.bfloat16())


def test_rmsnorm_prenorm_returns_the_normalised_sum_and_the_sum():
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    x, r = torch.randn(3, 5, 16, generator=g).double(), torch.randn(3, 5, 16, generator=g).double()
    y, s = norm(x, r, prenorm=True)
    assert torch.equal(s, x + r)
    assert (y - norm(x + r)).abs().max().item() < 1e-14
    assert (norm(x, r) - y).abs().max().item() == 0


@pytest.mark.parametrize("layer_cls", [EFLA, GatedEFLA])
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_prepare_qkv_beta_returns_what_the_op_integrates(layer_cls, rule):
    """The layer normalises q (and the Euler rule's k) inside the op; prepare_qkv_beta still shows
    the normalised inputs: the op on them, without normalisation, gives the layer's recurrence."""
    torch.manual_seed(3)
    kw = dict(hidden_size=32, num_heads=2) if layer_cls is EFLA else dict(hidden_size=32, num_heads=2, head_dim=16)
    layer = layer_cls(update_rule=rule, **kw).double()
    x = torch.randn(2, 9, 32).double()
    shown = layer.prepare_qkv_beta(x)
    raw = layer._recurrence_inputs(x, None, None, False, None)
    op = layer._op(recurrent=False)
    n_in = 4 if layer_cls is EFLA else 5
    o_shown, _ = op(*shown[:n_in])
    o_layer, _ = op(*raw[:n_in], use_q_l2norm_in_kernel=True, use_qk_l2norm_in_kernel=rule == "euler")
    assert (o_shown - o_layer).abs().max().item() < 1e-12
    assert torch.equal(shown[1], raw[1]) == (rule == "exact")  # EFLA's keys stay raw


def test_shift_labels_and_num_items_in_batch():
    torch.manual_seed(4)
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).double()
    ids = torch.randint(0, 256, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    loss = model(ids, labels=labels).loss
    shifted = EFLAForCausalLM.shift(labels)
    assert (model(ids, shift_labels=shifted).loss - loss).abs().item() < 1e-12
    count = int((shifted != -100).sum())
    summed = model(ids, labels=labels, num_items_in_batch=count).loss
    assert (summed - loss).abs().item() < 1e-12
    assert (model(ids, labels=labels, num_items_in_batch=2 * count).loss - loss / 2).abs().item() < 1e-12


def test_shift_labels_beside_labels_decide_the_loss_as_in_transformers():
    """Sequence-parallel trainers (accelerate, DeepSpeed) pass both; the loss is against shift_labels and
    labels are ignored, as transformers' ForCausalLMLoss does."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(5)
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).double()
    ids = torch.randint(0, 256, (2, 9))
    labels = ids.clone()
    shifted = torch.randint(0, 256, (2, 9))  # unrelated to labels: only one of them can give the loss
    shifted[1, -4:] = -100
    count = int((shifted != -100).sum())
    alone = model(input_ids=ids, shift_labels=shifted, num_items_in_batch=count)
    trainer_batch = dict(input_ids=ids, labels=labels, shift_labels=shifted)
    both = model(**trainer_batch, num_items_in_batch=count)
    assert (both.loss - alone.loss).abs().item() < 1e-12
    assert (both.loss - model(ids, labels=labels, num_items_in_batch=count).loss).abs().item() > 1e-3
    exact = F.cross_entropy(both.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum") / count
    assert (both.loss - exact).abs().item() < 1e-12  # a float64 model's loss in float64
    # transformers computes it in float32 whatever the logits
    reference = ForCausalLMLoss(both.logits, labels, model.config.vocab_size, num_items_in_batch=count, shift_labels=shifted)
    assert (both.loss - reference).abs().item() < 1e-5
    both.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad.abs().sum().item() > 0


# ----------------------------------------------------------------------------- interpreter (CPU)
@pytest.mark.skipif(not _READY, reason=_WHY)
def test_fused_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "tests.layers.fused_checks"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    errors = dict(line.split("\t") for line in r.stdout.strip().splitlines() if "\t" in line)
    assert len(errors) == len(fused_checks.module_cases("cpu")) + 4, r.stdout
    for name, err in errors.items():
        assert float(err) < 1e-4, (name, err)


# ----------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_modules_match_pytorch_modules_on_gpu(dtype, tol):
    if fused.kernels_for(torch.zeros(1, device="cuda")) is None:
        pytest.skip("flash-linear-attention not installed")
    for name, err in fused_checks.check_modules(torch.device("cuda"), dtype).items():
        assert err < tol, (name, err)


@needs_cuda
def test_in_op_l2norm_chunk_kernels_on_gpu():
    from efla.ops import cuda as backend

    if not backend.fla_available():
        pytest.skip("flash-linear-attention not installed")
    for name, err in fused_checks.check_chunk_ops(torch.device("cuda"), torch.bfloat16).items():
        assert err < 2e-2, (name, err)


@needs_cuda
@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla", "tiny-deltanet"])
def test_model_trains_the_same_through_fused_and_pytorch_modules(preset):
    if fused.kernels_for(torch.zeros(1, device="cuda")) is None:
        pytest.skip("flash-linear-attention not installed")
    torch.manual_seed(5)
    model = EFLAForCausalLM(get_preset_config(preset, vocab_size=512, hidden_size=128, num_heads=2)).cuda()
    ids = torch.randint(0, 512, (2, 300), device="cuda")

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    with fused.disabled():
        ref_loss, ref_grads = loss_and_grads()
    assert fused_checks.rel(loss, ref_loss) < 1e-5
    assert max(fused_checks.rel(a, b) for a, b in zip(grads, ref_grads)) < 1e-3
