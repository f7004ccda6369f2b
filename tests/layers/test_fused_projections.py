"""The layers can compute their input projections as one matrix product: same weights, same
results and gradients as the separate products, with and without beta's projection and the output
gate, padding, packed sequences, grouped value heads or a cache; wrapped or hooked projections and
inference run them one by one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from efla.layers import EFLA, GatedEFLA
from efla.models import EFLAConfig, EFLAForCausalLM

PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class CountProducts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in PRODUCTS
        return func(*args, **(kwargs or {}))


def _products(layer, x) -> int:
    with CountProducts() as counter:
        layer.input_projections(x)
    return counter.count


def _pair(layer_cls=GatedEFLA, **kw):
    torch.manual_seed(0)
    size = dict(hidden_size=32, num_heads=2) | (dict(head_dim=16) if layer_cls is GatedEFLA else {})
    fused = layer_cls(**size, **kw).double()
    assert fused.fuse_input_projections  # the default
    separate = copy.deepcopy(fused)
    separate.fuse_input_projections = False
    return separate, fused


def _expected_products(layer) -> int:
    if isinstance(layer, GatedEFLA):
        return 6 if layer.use_gate else 5
    return 3 + layer.use_beta + layer.use_gate


def _outputs_and_grads(layer, x, **kw):
    xi = x.clone().requires_grad_(True)
    o = layer(xi, **kw)[0]
    (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
    return o, [xi.grad] + [p.grad for p in layer.parameters()]


CASES = {
    "gated: output gate, padding": (GatedEFLA, dict(), "mask"),
    "gated: no output gate, padding": (GatedEFLA, dict(use_gate=False), "mask"),
    "gated: euler rule": (GatedEFLA, dict(update_rule="euler"), None),
    "gated: grouped values, negative eigenvalues": (GatedEFLA, dict(num_v_heads=4, allow_neg_eigval=True), None),
    "gated: no short convolutions": (GatedEFLA, dict(use_short_conv=False), None),
    "gated: packed sequences": (GatedEFLA, dict(), "cu_seqlens"),
    "efla: padding": (EFLA, dict(), "mask"),
    "efla: output gate, grouped values": (EFLA, dict(use_gate=True, num_v_heads=4), None),
    "efla: no beta projection, euler rule": (EFLA, dict(use_beta=False, update_rule="euler"), None),
    "efla: packed sequences, no short convolutions": (EFLA, dict(use_short_conv=False), "cu_seqlens"),
}


@pytest.mark.filterwarnings("ignore:use_short_conv=False")
@pytest.mark.parametrize("case", CASES)
def test_fused_projections_match_separate_ones(case):
    layer_cls, kw, extra = CASES[case]
    separate, fused = _pair(layer_cls, **kw)
    B = 1 if extra == "cu_seqlens" else 2
    x = torch.randn(B, 11, 32, dtype=torch.float64)
    call = {}
    if extra == "mask":
        call["attention_mask"] = torch.ones(2, 11, dtype=torch.long)
        call["attention_mask"][1, :3] = 0  # left padding
    elif extra == "cu_seqlens":
        call["cu_seqlens"] = torch.tensor([0, 4, 11])
    (o_sep, g_sep), (o_fused, g_fused) = (_outputs_and_grads(layer, x, **call) for layer in (separate, fused))
    assert (_products(separate, x), _products(fused, x)) == (_expected_products(separate), 1 + separate.use_gate)
    assert o_sep.abs().max().item() > 1e-3  # the layer computed something
    assert (o_sep - o_fused).abs().max().item() < 1e-12
    for a, b in zip(g_sep, g_fused):
        assert (a - b).abs().max().item() < 1e-12


def test_inference_and_hooked_projections_run_one_by_one():
    _, fused = _pair()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        assert _products(fused, x) == 6  # decoding reads the weights once each, no stacked copy
    shifted = fused(x)[0]
    handle = fused.q_proj.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    try:
        assert _products(fused, x) == 6
        hooked = fused(x)[0]
    finally:
        handle.remove()
    separate = copy.deepcopy(fused)
    separate.fuse_input_projections = False
    separate.q_proj.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    assert (hooked - shifted).abs().max().item() > 1e-6  # the hook changed the result
    assert (hooked - separate(x)[0]).abs().max().item() < 1e-12


@pytest.mark.parametrize("gated", [True, False])
def test_fused_projections_in_the_model_config_and_generation(gated):
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, gated=gated)
    torch.manual_seed(1)
    separate = EFLAForCausalLM(EFLAConfig(**cfg, fuse_input_projections=False)).double().eval()
    fused = EFLAForCausalLM(EFLAConfig(**cfg)).double().eval()
    fused.load_state_dict(separate.state_dict())  # same parameter names: checkpoints load either way
    assert fused.config.fuse_input_projections and EFLAConfig.from_dict(fused.config.to_dict()).fuse_input_projections
    assert not EFLAConfig.from_dict(separate.config.to_dict()).fuse_input_projections
    assert all(layer.attn.fuse_input_projections for layer in fused.model.layers)
    ids = torch.randint(0, 64, (2, 7))
    assert (separate(ids).logits - fused(ids).logits).abs().max().item() < 1e-12
    a = separate.generate(ids, max_new_tokens=4, do_sample=False)
    b = fused.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_wrapped_projections_are_not_bypassed():
    """A projection wrapped by PEFT's LoRA (or anything else that is not a bare ``nn.Linear``)
    computes more than its weight: the fused path must leave it to run."""
    peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install 'efla[peft]')")
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16, gated=True)
    logits = []
    for fuse in (False, True):
        torch.manual_seed(2)
        model = EFLAForCausalLM(EFLAConfig(**cfg, fuse_input_projections=fuse)).double().eval()
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "a_proj"]))
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_()  # LoRA starts at zero: make it change the projections
        logits.append(model(torch.arange(9).view(1, 9)).logits)
    assert (logits[0] - logits[1]).abs().max().item() < 1e-12


def test_fused_projections_keep_no_stacked_copy_for_backward():
    """Backward runs two products for the fused projections (input and weight gradients) and two
    for the output gate's own; autograd keeps only ``x`` and the separate weights: a stacked copy
    would add its size to peak memory at every layer."""
    _, fused = _pair()
    stacked = (fused.q_proj, fused.k_proj, fused.v_proj, fused.a_proj, fused.b_proj)
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outputs = fused.input_projections(x)
    stacked_rows = sum(layer.out_features for layer in stacked)
    assert all(t.shape != (stacked_rows, 32) for t in saved)
    # x (once for the stacked product, once for the gate's), the stacked weights, the gate's weight
    assert sum(t.numel() for t in saved) == 2 * x.numel() + (stacked_rows + fused.g_proj.out_features) * 32
    with CountProducts() as counter:
        sum(o.sum() for o in outputs).backward()
    assert counter.count == 4
    expected = torch.ones(2, 5, stacked_rows + fused.g_proj.out_features, dtype=torch.float64) @ torch.cat(
        [p.weight for p in (*stacked, fused.g_proj)]
    )
    assert (x.grad - expected).abs().max().item() < 1e-12


@pytest.mark.parametrize("gated", [True, False])
def test_fused_projections_under_bf16_autocast(gated):
    """float32 weights under autocast (transformers' Trainer with bf16=True): the stacked product
    runs in bfloat16 both ways and each weight gets a float32 gradient, as the separate products do."""
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, gated=gated)
    torch.manual_seed(4)
    fused = EFLAForCausalLM(EFLAConfig(**cfg))
    separate = copy.deepcopy(fused)
    separate.config.fuse_input_projections = False
    for layer in separate.model.layers:
        layer.attn.fuse_input_projections = False
    ids = torch.randint(0, 64, (2, 16))
    grads = []
    for model in (fused, separate):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    weight = "model.layers.0.attn.q_proj.weight"
    assert grads[0][weight].dtype == torch.float32
    for name, g in grads[1].items():
        assert (grads[0][name] - g).norm().item() <= 2e-2 * g.norm().item() + 1e-8, name


def test_backward_hooks_and_frozen_projections():
    """A projection with a backward hook runs on its own (the hook fires); frozen projections get
    no gradient and the trainable ones the same as with separate products."""
    separate, fused = _pair()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    fired = []
    fused.k_proj.register_full_backward_hook(lambda module, grad_in, grad_out: fired.append("k"))
    assert _products(fused, x) == 6
    fused(x.requires_grad_())[0].sum().backward()
    assert fired == ["k"]

    separate, fused = _pair()
    for layer in (separate, fused):
        layer.q_proj.weight.requires_grad_(False)
        layer.v_proj.weight.requires_grad_(False)
    (_, g_sep), (_, g_fused) = (_outputs_and_grads(layer, x.detach()) for layer in (separate, fused))
    assert fused.q_proj.weight.grad is None and fused.v_proj.weight.grad is None
    for a, b in zip(g_sep, g_fused):
        assert (a is None and b is None) or (a - b).abs().max().item() < 1e-12
    for layer in (separate, fused):
        for p in layer.parameters():
            p.requires_grad_(False)
    (_, g_sep), (_, g_fused) = (_outputs_and_grads(layer, x.detach()) for layer in (separate, fused))
    assert (g_sep[0] - g_fused[0]).abs().max().item() < 1e-12  # x's gradient through frozen layers
