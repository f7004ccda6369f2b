"""efla.generation on the CPU: greedy tokens equal transformers' generate without a cache for every
preset (ragged, left-padded batches; stop tokens), seeded sampling reproduces, the filters equal
transformers' warpers, draws follow the filtered distribution, and the state pool is allocated
once and updated in place."""

import pytest
import torch
import transformers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from efla.generation import choose_tokens, engine_for, filter_logits, generate, release
from efla.models import EFLACache, EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()

PRESETS = ["tiny-efla", "tiny-gated-efla", "tiny-deltanet", "tiny-gated-deltanet", "tiny-hybrid-efla"]


def tiny(preset, **kw):
    torch.manual_seed(0)
    # a wider init than the default: clear argmax margins, so rounding never decides a greedy token
    model = EFLAForCausalLM(get_preset_config(preset, initializer_range=0.1, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def ragged_batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, 256, (len(lengths), T), generator=g)  # garbage under the padding too
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n :] = 1
    return ids, mask


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_transformers_generate_without_cache(preset):
    model = tiny(preset)
    ids, mask = ragged_batch([9, 4, 6, 1])
    want = model.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, use_cache=False, eos_token_id=None, pad_token_id=0
    )
    got = generate(model, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert got.shape == want.shape == (4, 9 + 24)
    assert torch.equal(got, want)


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-hybrid-efla"])
def test_stop_tokens_end_rows_as_transformers_does(preset):
    model = tiny(preset)
    ids, mask = ragged_batch([7, 3, 5])
    free = generate(model, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    stop = int(free[0, 7 + 3])  # row 0's fourth new token: row 0 stops there, the others when (if) they meet it
    kw = dict(attention_mask=mask, max_new_tokens=20)
    want = model.generate(ids, do_sample=False, use_cache=False, eos_token_id=stop, pad_token_id=0, **kw)
    got = generate(model, ids, eos_token_id=stop, pad_token_id=0, **kw)
    assert torch.equal(got, want)
    assert (got[0, 7 + 4 :] == 0).all()


def test_prompt_of_one_row_equals_that_row_of_a_batch():
    model = tiny("tiny-gated-efla")
    ids, mask = ragged_batch([8, 5, 2])
    batch = generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    for i, n in enumerate([8, 5, 2]):
        alone = generate(model, ids[i : i + 1, 8 - n :], max_new_tokens=12, eos_token_id=[])
        assert torch.equal(batch[i, 8:], alone[0, n:])


def test_seeded_sampling_reproduces_and_seeds_differ():
    model = tiny("tiny-efla")
    ids, mask = ragged_batch([6, 6])
    kw = dict(attention_mask=mask, max_new_tokens=16, temperature=1.3, top_k=40, top_p=0.9, eos_token_id=[])
    a = generate(model, ids, seed=7, **kw)
    assert torch.equal(a, generate(model, ids, seed=7, **kw))
    assert not torch.equal(a, generate(model, ids, seed=8, **kw))
    torch.manual_seed(3)
    b = generate(model, ids, **kw)
    torch.manual_seed(3)
    assert torch.equal(b, generate(model, ids, **kw))  # unseeded: torch's global generator decides


def test_a_seed_per_row_samples_each_row_as_if_alone():
    """With one seed per row, a row's sample is that prompt's sample alone with its seed: the rows
    beside it change nothing; two rows of one prompt with two seeds sample differently."""
    model = tiny("tiny-efla")
    ids, mask = ragged_batch([6, 4, 6])
    ids[2], mask[2] = ids[0], mask[0]  # rows 0 and 2: the same prompt
    kw = dict(max_new_tokens=16, temperature=1.3, top_k=40, top_p=0.9, eos_token_id=[])
    batch = generate(model, ids, attention_mask=mask, seed=[11, 12, 13], **kw)
    for row, (n, seed) in enumerate(zip([6, 4, 6], [11, 12, 13])):
        alone = generate(model, ids[row : row + 1, 6 - n :], seed=[seed], **kw)
        assert torch.equal(batch[row, 6:], alone[0, n:])
    assert not torch.equal(batch[0, 6:], batch[2, 6:])
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(model, ids, attention_mask=mask, seed=[1, 2], **kw)


def transformers_filter(logits, temperature, top_k, top_p):
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits.clone())


SETTINGS = [(1.0, None, None), (0.7, 5, None), (1.5, None, 0.8), (0.9, 20, 0.5), (2.0, 1, 0.9), (1.0, 300, 0.99), (0.5, 0, 0.3)]


def test_filters_equal_transformers_warpers_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(SETTINGS), 257, generator=g) * 3
    logits[:, :40] = logits[:, :40].round()  # ties at the top-k border, as transformers keeps them
    temperature = torch.tensor([t for t, _, _ in SETTINGS])
    top_k = torch.tensor([k or 0 for _, k, _ in SETTINGS])
    top_p = torch.tensor([1.0 if p is None else p for _, _, p in SETTINGS])
    got = filter_logits(logits, temperature, top_k, top_p)
    for row, (t, k, p) in enumerate(SETTINGS):
        want = transformers_filter(logits[row : row + 1], t, k, p)[0]
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), (t, k, p)
        kept = ~torch.isinf(want)
        assert torch.allclose(got[row][kept], want[kept], rtol=0, atol=0), (t, k, p)
        assert 1 <= int(kept.sum()) <= (k or 257)


def test_draws_follow_the_filtered_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 12, generator=g) * 1.5
    rows = 40_000
    temperature, top_k, top_p = torch.full((rows,), 0.8), torch.full((rows,), 6), torch.full((rows,), 0.9)
    probs = filter_logits(logits, temperature[:1], top_k[:1], top_p[:1]).softmax(-1)[0]
    noise = torch.empty(rows, 12).exponential_(generator=g)
    drawn = choose_tokens(logits.expand(rows, 12), temperature, top_k, top_p, noise)
    freq = torch.bincount(drawn, minlength=12).double() / rows
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs.double()).abs().max() < 4 * (0.25 / rows) ** 0.5  # 4 standard errors at most
    greedy = choose_tokens(logits.expand(3, 12), torch.zeros(3), top_k[:3], top_p[:3], noise[:3])
    assert (greedy == logits.argmax()).all()


def test_state_pool_is_allocated_once_and_updated_in_place():
    model = tiny("tiny-gated-efla")
    release(model)
    ids, mask = ragged_batch([5, 3])
    generate(model, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[])
    engine = engine_for(model)
    pool = [t for state in engine.cache.states for t in (state["recurrent_state"], *state["conv_state"])]
    before = [(t.data_ptr(), t.shape) for t in pool]
    generate(model, ids, attention_mask=mask, max_new_tokens=40, eos_token_id=[])
    assert engine_for(model) is engine
    assert [(t.data_ptr(), t.shape) for t in pool] == before
    assert [t.data_ptr() for state in engine.cache.states for t in (state["recurrent_state"], *state["conv_state"])] == [
        p for p, _ in before
    ]


def test_transformers_generate_updates_the_cache_in_place():
    model = tiny("tiny-efla")
    ids = torch.randint(3, 256, (2, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert isinstance(cache, EFLACache)
        held = [cache[0]["recurrent_state"].data_ptr(), *(c.data_ptr() for c in cache[0]["conv_state"])]
        model(ids[:, :1], past_key_values=cache, use_cache=True)
        assert [cache[0]["recurrent_state"].data_ptr(), *(c.data_ptr() for c in cache[0]["conv_state"])] == held


def test_bad_arguments_name_themselves():
    model = tiny("tiny-efla")
    ids, mask = ragged_batch([4, 2])
    right = mask.flip(1)
    for kwargs, name in (
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(attention_mask=right), "left"),
    ):
        with pytest.raises(ValueError, match=name):
            generate(model, ids, **{"attention_mask": mask, **kwargs})
