"""Hybrid models (config ``attn``): softmax-attention blocks among EFLA blocks."""

import copy
import math

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from efla.layers import EFLA, Attention, GatedEFLA
from efla.models import EFLACache, EFLAConfig, EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_heads=2)


def hybrid(dtype=torch.float32, window=None, gated=False):
    torch.manual_seed(0)
    attn = {"layers": [0, 2], "num_heads": 4, "num_kv_heads": 2, "window_size": window, "qkv_bias": True}
    cfg = EFLAConfig(**SMALL, gated=gated, attn=attn)
    model = EFLAForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # every tensor non-trivial, norms included
    return model


def cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def test_blocks_follow_attn_layers_and_preset():
    model = hybrid(gated=True)
    assert [type(layer.attn) for layer in model.model.layers] == [Attention, GatedEFLA, Attention]
    preset = get_preset_config("tiny-hybrid-efla")
    assert preset.attn == {
        "layers": [1],
        "num_heads": 2,
        "num_kv_heads": 2,
        "qkv_bias": False,
        "window_size": None,
        "rope_theta": 10000.0,
    }
    assert [type(layer.attn) for layer in EFLAForCausalLM(preset).model.layers] == [EFLA, Attention]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("window", [None, 3])
def test_prefill_then_token_by_token_equals_full_forward(dtype, tol, window):
    model = hybrid(dtype, window)
    ids = torch.randint(0, 256, (2, 14))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6], use_cache=True)
        logits = [out.logits]
        out = model(ids[:, 6:9], past_key_values=cache_of(out), use_cache=True)  # a multi-token chunk
        logits.append(out.logits)
        for t in range(9, 14):
            out = model(ids[:, t : t + 1], past_key_values=cache_of(out), use_cache=True)
            logits.append(out.logits)
    inc = torch.cat(logits, 1)
    assert ((inc - full).abs().max() / full.abs().max()).item() < tol
    cache = cache_of(out)
    assert isinstance(cache, EFLACache) and cache.get_seq_length() == 14
    assert cache[0]["attn_state"][0].shape[1] == (14 if window is None else window - 1)
    assert cache[1]["recurrent_state"].shape[0] == 2


def test_generate_with_and_without_cache_and_beams():
    model = hybrid(window=4)
    ids = torch.randint(3, 256, (2, 6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        a = model.generate(ids, use_cache=True, **kw)
        assert a.shape == (2, 12) and torch.equal(a, model.generate(ids, use_cache=False, **kw))
        beams = dict(kw, num_beams=3)
        assert torch.equal(model.generate(ids, use_cache=True, **beams), model.generate(ids, use_cache=False, **beams))


def test_left_padded_batch_matches_each_sequence_alone():
    model = hybrid(torch.float64, window=4)
    lens = [8, 3, 5]
    T = max(lens)
    seqs = [torch.randint(3, 256, (1, n)) for n in lens]
    ids = torch.randint(3, 256, (3, T))  # garbage under the padding
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - lens[i] :], mask[i, T - lens[i] :] = s[0], 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            torch.testing.assert_close(batch[i, T - lens[i] :], model(s).logits[0], rtol=1e-10, atol=1e-10)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for i, s in enumerate(seqs):
            alone = model.generate(s, attention_mask=torch.ones_like(s), max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.equal(gen[i, T:], alone[0, lens[i] :])


def test_packed_prefill_continues_as_a_batch():
    model = hybrid(torch.float64)
    lens = [6, 2, 4]
    seqs = [torch.randint(3, 256, (n,)) for n in lens]
    cu = torch.tensor([0, 6, 8, 12], dtype=torch.int32)
    nxt = torch.randint(3, 256, (3, 1))
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=True)
        for i, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(packed.logits[0, cu[i] : cu[i + 1]], alone, rtol=1e-10, atol=1e-10)
        got = model(nxt, past_key_values=cache_of(packed), use_cache=True).logits[:, -1]
        for i, s in enumerate(seqs):
            want = model(torch.cat([s, nxt[i]])[None]).logits[0, -1]
            torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-10)


def test_save_and_reload_gives_identical_outputs(tmp_path):
    model = hybrid(window=5)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=True).eval()
    assert loaded.config.attn == model.config.attn and isinstance(loaded.model.layers[2].attn, Attention)
    assert set(loaded.state_dict()) == set(model.state_dict())
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_tiny_hybrid_preset_learns_a_repeated_motif():
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config("tiny-hybrid-efla")).train()
    motif = torch.randint(0, 256, (8,))
    ids = motif.repeat(5)[None].repeat(2, 1)
    ids[1] = torch.roll(ids[1], shifts=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(40):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            attention = model.model.layers[1].attn
            for name, p in attention.named_parameters():
                assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 5.0 and losses[-1] < 0.3, losses[::5]  # the motif is predictable after its first occurrence


@pytest.mark.parametrize(
    "attn,match",
    [
        ([{"layers": [1], "num_heads": 2}], "list"),
        ("layers=1", "dict"),
        ({"num_heads": 2}, "missing required key"),
        ({"layers": [1], "num_heads": 2, "heads_kv": 1}, "unknown key"),
        ({"layers": [3], "num_heads": 2}, "out of range"),
        ({"layers": [-1], "num_heads": 2}, "out of range"),
        ({"layers": [1, 1], "num_heads": 2}, "more than once"),
        ({"layers": 1, "num_heads": 2}, "list of layer indices"),
        ({"layers": [True], "num_heads": 2}, "int layer indices"),
        ({"layers": [1], "num_heads": 3}, "do not divide hidden_size"),
        ({"layers": [1], "num_heads": 32}, "even"),
        ({"layers": [1], "num_heads": 4, "num_kv_heads": 3}, "do not divide num_heads"),
        ({"layers": [1], "num_heads": 0}, "positive int"),
        ({"layers": [1], "num_heads": 2, "window_size": 0}, "window_size"),
        ({"layers": [1], "num_heads": 2, "qkv_bias": 1}, "qkv_bias"),
        ({"layers": [1], "num_heads": 2, "rope_theta": float("inf")}, "rope_theta"),
    ],
)
def test_invalid_attn_configs_raise_clear_errors(attn, match):
    with pytest.raises(ValueError, match=match):
        EFLAConfig(**SMALL, attn=attn)


def test_context_parallel_refuses_attention_layers():
    from efla.distributed.context_parallel import context_parallel_scope, shard_layout

    model = hybrid()
    with context_parallel_scope(shard_layout(8, 1, 0)), pytest.raises(ValueError, match="context parallel"):
        model(torch.randint(0, 256, (1, 8)))


def test_train_refuses_context_parallelism_for_hybrid_models(tmp_path):
    from efla.errors import UsageError
    from efla.training.trainer import TrainConfig, check_train_config

    (tmp_path / "a.txt").write_text("some text\n")
    cfg = TrainConfig(data=[str(tmp_path)], out=str(tmp_path / "out"), preset="tiny-hybrid-efla", context_parallel=2)
    with pytest.raises(UsageError, match="softmax-attention layers \\[1\\] \\(--context-parallel\\)"):
        check_train_config(cfg)
    check_train_config(TrainConfig(data=[str(tmp_path)], out=str(tmp_path / "out"), preset="tiny-efla", context_parallel=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 4])
def test_hybrid_on_gpu_matches_the_cpu_in_bf16(window):
    """bf16 on the GPU (SDPA's CUDA kernels, the fused modules, the chunk ops) against float64 on the
    CPU: full forward, and prefill plus token-by-token decoding with the cache."""
    reference = hybrid(torch.float64, window)
    model = copy.deepcopy(reference).to("cuda", torch.bfloat16)  # hybrid(float32) draws other weights
    ids = torch.randint(0, 256, (2, 70))
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        full = model(ids.cuda(), use_cache=False).logits.double().cpu()
        out = model(ids[:, :64].cuda(), use_cache=True)
        steps = [out.logits]
        for t in range(64, 70):
            out = model(ids[:, t : t + 1].cuda(), past_key_values=cache_of(out), use_cache=True)
            steps.append(out.logits)
    incremental = torch.cat(steps, 1).double().cpu()
    for got in (full, incremental):
        assert torch.isfinite(got).all()
        assert ((got - expected).norm() / expected.norm()).item() < 2e-2
