"""save_pretrained / Auto* reload: safetensors only, identical logits, no pickle."""

import pickle

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import efla.models  # noqa: F401  (registers the Auto classes)
from efla.models import EFLAConfig, EFLAForCausalLM, EFLAModel, get_preset_config

transformers.logging.set_verbosity_error()


@pytest.fixture
def no_pickle(monkeypatch):
    """Any unpickling during the block fails the test."""

    def refuse(*a, **k):
        raise AssertionError("pickle was used while loading")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    yield


@pytest.mark.parametrize("variant,tied", [("efla", False), ("gated-deltanet", False), ("gated-efla", True)])
def test_save_and_auto_reload(tmp_path, variant, tied, request):
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(f"tiny-{variant}", tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for p in model.parameters():  # every tensor random so a missed/re-initialised one shows
            p.add_(0.05 * torch.randn_like(p))
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]

    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
    request.getfixturevalue("no_pickle")
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, EFLAConfig) and cfg.model_type == "efla"
    skip = {"_name_or_path", "architectures"}
    assert {k: v for k, v in cfg.to_dict().items() if k not in skip} == {
        k: v for k, v in model.config.to_dict().items() if k not in skip
    }
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=True).eval()
    assert isinstance(loaded, EFLAForCausalLM)
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, ref)
    for (n, p), (m, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    base = AutoModel.from_pretrained(tmp_path, use_safetensors=True)
    assert isinstance(base, EFLAModel)
    torch.testing.assert_close(base.embeddings.weight, model.model.embeddings.weight, rtol=0, atol=0)


def test_checkpoint_loads_into_other_update_rule(tmp_path):
    """One checkpoint, both rules: same tensors, different recurrence (the `efla convert` story)."""
    torch.manual_seed(0)
    euler = EFLAForCausalLM(get_preset_config("tiny-deltanet")).eval()
    euler.save_pretrained(tmp_path)
    exact = EFLAForCausalLM.from_pretrained(tmp_path, update_rule="exact", use_safetensors=True).eval()
    assert exact.config.update_rule == "exact"
    for (n, p), (m, q) in zip(euler.state_dict().items(), exact.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert not torch.allclose(exact(ids).logits, euler(ids).logits)


def test_fla_tensor_names():
    """The model's tensor names are flash-linear-attention's DeltaNet / GatedDeltaNet names."""
    names = set(EFLAForCausalLM(get_preset_config("tiny-deltanet")).state_dict())
    layer = {
        "attn_norm.weight",
        "attn.q_proj.weight",
        "attn.k_proj.weight",
        "attn.v_proj.weight",
        "attn.b_proj.weight",
        "attn.q_conv1d.weight",
        "attn.k_conv1d.weight",
        "attn.v_conv1d.weight",
        "attn.o_norm.weight",
        "attn.o_proj.weight",
        "mlp_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    expected = {"model.embeddings.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(2) for n in layer}
    assert names == expected
    gnames = set(EFLAForCausalLM(get_preset_config("tiny-gated-deltanet")).state_dict())
    extra = {"attn.a_proj.weight", "attn.A_log", "attn.dt_bias", "attn.g_proj.weight"}
    assert gnames == expected | {f"model.layers.{i}.{n}" for i in range(2) for n in extra}
