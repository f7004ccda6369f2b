"""Models with grouped value heads (num_v_heads = 2 * num_heads): train, save/load, decode."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import efla.models  # noqa: F401  (registers the Auto classes)
from efla.models import EFLAConfig, EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()

VARIANTS = ["efla", "gated-efla", "deltanet", "gated-deltanet"]


def tiny_grouped(variant):
    torch.manual_seed(0)
    cfg = get_preset_config(f"tiny-{variant}", num_v_heads=4)  # the tiny presets have 2 q/k heads
    model = EFLAForCausalLM(cfg)
    with torch.no_grad():  # every tensor random, so a tensor missed on reload shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


@pytest.mark.parametrize("variant", ["efla", "gated-efla"])
def test_grouped_model_trains_a_step(variant):
    model = tiny_grouped(variant).train()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert model.model.layers[0].attn.v_proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_model_states_and_decoding(variant):
    model = tiny_grouped(variant).eval()
    attn = model.model.layers[0].attn
    assert attn.num_heads == 2 and attn.num_v_heads == 4
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :9], use_cache=True)
        logits = [out.logits]
        for t in range(9, 13):
            out = model(ids[:, t : t + 1], past_key_values=cache_of(out), use_cache=True)
            logits.append(out.logits)
    state = cache_of(out)[0]["recurrent_state"]
    assert state.shape == (2, 4, attn.head_k_dim, attn.head_v_dim)  # one state per value head
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-5)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("variant", ["efla", "gated-efla"])
def test_grouped_model_save_and_reload(tmp_path, variant):
    model = tiny_grouped(variant).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=True).eval()
    assert loaded.config.num_v_heads == 4
    for (n, p), (m, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    ids = torch.randint(0, 256, (1, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("num_v_heads", [3, 0, 2.0, True])
def test_config_refuses_value_heads_not_a_multiple_of_heads(num_v_heads):
    with pytest.raises(ValueError, match="^num_v_heads: expected"):
        EFLAConfig(num_heads=2, num_v_heads=num_v_heads)


def test_config_default_value_heads_are_the_heads():
    assert EFLAConfig(num_heads=2).num_v_heads is None
    model = EFLAForCausalLM(get_preset_config("tiny-efla"))
    assert model.model.layers[0].attn.num_v_heads == 2
