"""EFLAForCausalLM: incremental decoding, generate, left padding, packed input."""

import pytest
import torch
import transformers

from efla.models import EFLACache, EFLAConfig, EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()

VARIANTS = ["efla", "gated-efla", "deltanet", "gated-deltanet"]


def tiny(variant, **kw):
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(f"tiny-{variant}", **kw)).eval()
    with torch.no_grad():  # make the norms and gates non-trivial
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decoding_matches_full_forward(variant):
    model = tiny(variant)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :10], use_cache=True)
        cache = cache_of(out)
        assert isinstance(cache, EFLACache) and cache.get_seq_length() == 10
        logits = [out.logits]
        out = model(ids[:, 10:13], past_key_values=cache, use_cache=True)  # a multi-token chunk
        logits.append(out.logits)
        for t in range(13, 24):  # then token by token
            out = model(ids[:, t : t + 1], past_key_values=cache_of(out), use_cache=True)
            logits.append(out.logits)
    inc = torch.cat(logits, 1)
    assert inc.dtype == torch.float32
    assert rel(inc, full) < 1e-4
    assert cache_of(out).get_seq_length() == 24
    # the cache is constant-size: one [B, H, K, V] state and three conv states per layer
    st = cache_of(out)[0]
    assert st["recurrent_state"].dtype == torch.float32 and st["recurrent_state"].shape[0] == 2
    assert len(st["conv_state"]) == 3 and st["conv_state"][0].shape[-1] == 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_with_and_without_cache(variant):
    model = tiny(variant)
    ids = torch.randint(3, 256, (2, 7))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        a = model.generate(ids, use_cache=True, **kw)
        b = model.generate(ids, use_cache=False, **kw)
    assert a.shape == (2, 15)
    assert torch.equal(a, b)


def test_beam_search_reorders_cache():
    model = tiny("gated-efla")
    ids = torch.randint(3, 256, (2, 7))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padding_matches_unpadded(variant):
    model = tiny(variant)
    lens = [9, 4, 6]
    T = max(lens)
    seqs = [torch.randint(3, 256, (1, n)) for n in lens]
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - lens[i] :] = s[0]
        ids[i, : T - lens[i]] = torch.randint(3, 256, (T - lens[i],))  # garbage under the padding
        mask[i, T - lens[i] :] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            single = model(s).logits[0]
            assert rel(batch[i, T - lens[i] :], single) < 1e-5
        # greedy generation from the padded batch equals generation from each prompt alone
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        for i, s in enumerate(seqs):
            alone = model.generate(s, attention_mask=torch.ones_like(s), max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(gen[i, T:], alone[0, lens[i] :])


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_varlen_matches_padded_batch(variant):
    model = tiny(variant)
    lens = [9, 4, 6]
    T = max(lens)
    seqs = [torch.randint(3, 256, (n,)) for n in lens]
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - lens[i] :], mask[i, T - lens[i] :] = s, 1
    cu = torch.tensor([0, 9, 13, 19], dtype=torch.int32)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=True)
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=True)
        for i in range(3):
            assert rel(packed.logits[0, cu[i] : cu[i + 1]], padded.logits[i, T - lens[i] :]) < 1e-5
        # the packed prefill leaves one cache row per sequence: decoding continues as a batch
        nxt = torch.randint(3, 256, (3, 1))
        a = model(nxt, past_key_values=cache_of(packed), use_cache=True).logits
        b = model(nxt, past_key_values=cache_of(padded), use_cache=True).logits
    assert rel(a, b) < 1e-5
    # the packed loss never predicts across a sequence boundary: equals the per-sequence losses
    with torch.no_grad():
        loss = model(torch.cat(seqs)[None], labels=torch.cat(seqs)[None], cu_seqlens=cu).loss
        per = [model(s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs]
    torch.testing.assert_close(loss, sum(per) / (sum(lens) - 3), rtol=1e-5, atol=1e-6)


def test_base_model_hidden_states_and_embeds():
    model = tiny("efla")
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        a = model(ids, output_hidden_states=True)
        b = model(inputs_embeds=model.get_input_embeddings()(ids))
    assert len(a.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(a.logits, b.logits)
    with pytest.raises(ValueError, match="input_ids"):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))
    with pytest.raises(ValueError, match="past_key_values"):
        model(ids, past_key_values=(torch.zeros(1),), use_cache=True)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :3])


def test_model_stats_and_logits_to_keep():
    model = tiny("gated-efla")
    ids = torch.randint(0, 256, (2, 6))
    model.set_record_stats(True)
    with torch.no_grad():
        out = model(ids, logits_to_keep=1)
    assert out.logits.shape == (2, 1, 256)
    stats = model.get_stats()
    assert len(stats) == 2 and stats[0]["stiffness"].shape == (2, 6, 2)
    assert torch.isfinite(stats[1]["stiffness"]).all() and (stats[1]["stiffness"] > 0).all()
    model.set_record_stats(False)
    assert model.get_stats() == [None, None]


def test_config_validation_and_variants():
    for name, variant in [
        ("tiny-efla", "efla"),
        ("tiny-deltanet", "deltanet"),
        ("tiny-gated-efla", "gated_efla"),
        ("tiny_gated_deltanet", "gated_deltanet"),
    ]:
        assert get_preset_config(name).variant == variant
    with pytest.raises(ValueError, match="update_rule"):
        EFLAConfig(update_rule="rk4")
    with pytest.raises(ValueError, match="name"):
        get_preset_config("7b-efla")
    cfg = EFLAConfig(gated=True, hidden_size=64, num_heads=2)
    assert cfg.use_gate is True and cfg.expand_v == 2.0 and cfg.head_dim == 32  # fla's GDN defaults
    cfg = EFLAConfig(hidden_size=64, num_heads=2)
    assert cfg.use_gate is False and cfg.expand_v == 1.0  # fla's DeltaNet defaults
    again = EFLAConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
