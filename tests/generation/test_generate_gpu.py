"""efla.generation on a GPU: the fused step and CUDA graphs give transformers' tokens (bf16: most
prompts over 64 tokens, first-step logits within bf16 tolerance; float32: all), speculative
decoding's plain steps replay the captured step, a replayed step allocates nothing, and 8K generated
tokens peak at the memory of 128."""

import pytest
import torch
import transformers

from efla.generation import engine_for, generate, release
from efla.models import EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_heads=2, head_dim=128)


def small(preset, dtype, trained=False):
    torch.manual_seed(0)
    overrides = dict(SMALL, attn={"layers": [1], "num_heads": 2}) if preset == "hybrid" else SMALL
    name = "tiny-efla" if preset == "hybrid" else f"tiny-{preset}"
    model = EFLAForCausalLM(get_preset_config(name, **overrides))
    if trained:
        learn_a_sequence_rule(model)
    return model.cuda().to(dtype).eval()


def rule_sequences(batch, length, generator):
    """Token t + 1 = (5 t + 3) mod V: a rule a model learns in a few hundred steps, after which it
    predicts with clear margins (a random model's near-ties make bf16 greedy paths part anyway)."""
    start = torch.randint(0, SMALL["vocab_size"], (batch, 1), generator=generator)
    steps = torch.arange(length)
    tokens = [start]
    for _ in steps[1:]:
        tokens.append((5 * tokens[-1] + 3) % SMALL["vocab_size"])
    return torch.cat(tokens, 1)


def learn_a_sequence_rule(model, steps=100):
    """Trained on the CPU in float32 (seconds there; on a fresh GPU machine the backward kernels'
    compilation alone takes minutes)."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids = rule_sequences(16, 64, g)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def prompts(batch=8, longest=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, longest + 1, (batch,), generator=g)
    ids = rule_sequences(batch, longest, g)
    ids[:, : longest // 2] = torch.randint(3, SMALL["vocab_size"], (batch, longest // 2), generator=g)  # noise first
    mask = (torch.arange(longest) >= longest - lengths[:, None]).long()
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("preset", ["efla", "gated-efla", "deltanet", "hybrid"])
def test_bf16_tokens_and_first_logits_match_transformers(preset):
    model = small(preset, torch.bfloat16, trained=True)
    ids, mask = prompts()
    want = model.generate(
        ids, attention_mask=mask, max_new_tokens=64, do_sample=False, use_cache=False, eos_token_id=None, pad_token_id=0
    )
    got = generate(model, ids, attention_mask=mask, max_new_tokens=64, eos_token_id=[])
    same = [torch.equal(g, w) for g, w in zip(got, want)]
    assert sum(same) >= 6, same
    engine = engine_for(model)
    rows = [ids[i, mask[i] == 1] for i in range(len(ids))]
    first = engine.prefill(rows, torch.arange(len(rows), device="cuda"))
    full = model(ids, attention_mask=mask).logits[:, -1].float()
    assert ((first - full).norm() / full.norm()).item() < 2e-2


@pytest.mark.parametrize("preset", ["efla", "gated-deltanet"])
def test_float32_tokens_equal_transformers(preset):
    model = small(preset, torch.float32)
    ids, mask = prompts(batch=4, longest=40)
    ids = torch.randint(3, SMALL["vocab_size"], ids.shape, device="cuda")
    want = model.generate(
        ids, attention_mask=mask, max_new_tokens=32, do_sample=False, use_cache=False, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=32, eos_token_id=[]), want)


@pytest.mark.parametrize("verify_cost", [None, 1000])
def test_speculative_greedy_equals_plain_greedy_with_captured_steps(verify_cost):
    """Speculation's turned-down rounds replay the engine's captured step between eager verification
    passes (``verify_cost=1000``: every round a plain step): the tokens are plain greedy's (float32)."""
    model = small("efla", torch.float32, trained=True)
    ids, mask = prompts()
    ids = torch.cat([ids, ids[:, -32:]], 1)  # the prompts' last 32 tokens again: prompt lookup has drafts
    mask = torch.cat([mask, torch.ones_like(mask[:, -32:])], 1)
    want = generate(model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[])
    stats = {}
    speculate = {"method": "ngram", "verify_cost": verify_cost}
    got = generate(
        model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[], speculate=speculate, speculation_stats=stats
    )
    assert torch.equal(got, want)
    if verify_cost == 1000:  # every token after the first from a replayed step
        assert stats["verified"] == 0 and stats["rounds"] == 47


def test_a_replayed_step_allocates_nothing():
    model = small("gated-efla", torch.bfloat16)
    ids, mask = prompts(batch=3)
    for temperature in (0.0, 1.0):
        generate(model, ids, attention_mask=mask, max_new_tokens=4, temperature=temperature, seed=0, eos_token_id=[])
    engine = engine_for(model)
    bucket = engine.bucket(3)
    assert set(bucket.graphs) == {False, True}
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for sampling in (False, True) * 10:
        engine.step(bucket, sampling, generator)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_8k_new_tokens_peak_at_the_memory_of_128():
    model = small("efla", torch.bfloat16)
    release(model)
    ids = torch.randint(3, SMALL["vocab_size"], (1, 512), device="cuda")

    def peak(new_tokens):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    peak(128)  # captures the step
    short, long = peak(128), peak(8192)
    assert long - short <= 8192 * 8 * 2 + (1 << 20), (short, long)  # the output ids (and their copy), nothing else
