"""Gated layers can compute their input projections as one matrix product: same weights, same
results and gradients as the separate products, with and without the output gate, padding or a
cache."""

from __future__ import annotations

import copy

import pytest
import torch

from efla.layers import GatedEFLA
from efla.models import EFLAConfig, EFLAForCausalLM


def _pair(**kw):
    torch.manual_seed(0)
    separate = GatedEFLA(hidden_size=32, num_heads=2, head_dim=16, **kw).double()
    fused = copy.deepcopy(separate)
    fused.fuse_input_projections = True
    return separate, fused


@pytest.mark.parametrize("use_gate", [True, False])
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_fused_projections_match_separate_ones(use_gate, rule):
    separate, fused = _pair(use_gate=use_gate, update_rule=rule)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    outputs, grads = [], []
    for layer in (separate, fused):
        xi = x.clone().requires_grad_(True)
        o = layer(xi, attention_mask=mask)[0]
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        outputs.append(o)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    assert (outputs[0] - outputs[1]).abs().max().item() < 1e-12
    assert outputs[0].abs().max().item() > 1e-3  # the layer computed something
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-12


def test_fused_projections_in_the_model_config_and_generation():
    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, gated=True)
    torch.manual_seed(1)
    separate = EFLAForCausalLM(EFLAConfig(**cfg)).double().eval()
    fused = EFLAForCausalLM(EFLAConfig(**cfg, fuse_input_projections=True)).double().eval()
    fused.load_state_dict(separate.state_dict())  # same parameter names: checkpoints load either way
    assert fused.config.fuse_input_projections and EFLAConfig.from_dict(fused.config.to_dict()).fuse_input_projections
    assert all(layer.attn.fuse_input_projections for layer in fused.model.layers)
    ids = torch.randint(0, 64, (2, 7))
    assert (separate(ids).logits - fused(ids).logits).abs().max().item() < 1e-12
    a = separate.generate(ids, max_new_tokens=4, do_sample=False)
    b = fused.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_wrapped_projections_are_not_bypassed():
    """A projection wrapped by PEFT's LoRA (or anything else that is not a plain ``nn.Linear``)
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
