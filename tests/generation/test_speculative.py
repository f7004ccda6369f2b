"""Speculative decoding (efla.generation.speculative) on the CPU in float32: greedy tokens equal
non-speculative greedy for every tiny preset (ragged batches, prompt lookup and a draft model, stop
tokens inside accepted runs), the recurrent state after generation equals the non-speculative
state, and sampled tokens follow the target model's exact distribution (a chi-square test that a
wrong acceptance rule fails)."""

import copy
import itertools
import math

import pytest
import torch

import efla.generation.speculative as speculative
from efla.generation import engine_for, generate
from efla.generation.engine import DecodeEngine
from efla.models import EFLAForCausalLM, get_preset_config

PRESETS = ["tiny-efla", "tiny-gated-efla", "tiny-deltanet", "tiny-gated-deltanet", "tiny-hybrid-efla"]


def looping(preset, seed=0, **kw):
    """A random model at the default initialisation: its greedy text falls into loops, so prompt
    lookup's drafts are often right (and sometimes wrong)."""
    torch.manual_seed(seed)
    return EFLAForCausalLM(get_preset_config(preset, **kw)).eval()


def noisy_copy(model, scale=0.1, seed=3):
    """A draft model that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std().nan_to_num(0) * torch.randn(p.shape, generator=g))
    return draft


def ragged_batch(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n :] = 1
    return ids, mask


def methods(model, verify_cost=1):
    """The two drafters; ``verify_cost=1`` verifies every round that has a draft (so both kept and
    rejected drafts happen), ``None`` lets the turn-down rule take plain steps where a pass does not pay."""
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
            "verify_cost": verify_cost,
        },
        "draft_model": {
            "method": "draft_model",
            "model": noisy_copy(model),
            "num_speculative_tokens": 3,
            "verify_cost": verify_cost,
        },
    }


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_non_speculative_greedy(preset, method):
    model = looping(preset)
    ids, mask = ragged_batch([9, 4, 6, 1])
    want = generate(model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[])
    stats = {}
    got = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=48,
        eos_token_id=[],
        speculate=methods(model)[method],
        speculation_stats=stats,
    )
    assert torch.equal(got, want)
    # drafts were kept (a pass worth several tokens); the noisy draft model's are also rejected (rollback),
    # while prompt lookup keeps every draft of some presets' loops
    assert 0 < stats["accepted"] <= stats["drafted"]
    if method == "draft_model":
        assert stats["accepted"] < stats["drafted"]
    assert stats["rounds"] < 4 * 47
    assert stats["tokens"] == 4 * 48


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla", "tiny-hybrid-efla"])
def test_state_after_generation_equals_the_non_speculative_state(preset):
    """Both runs leave each row's state after its prompt and all new tokens but the last: the
    speculative one, after rollbacks, holds the same numbers (to float32 rounding of chunked sums)."""
    model = looping(preset)
    ids, mask = ragged_batch([7, 3, 5])
    kw = dict(attention_mask=mask, max_new_tokens=40, eos_token_id=[])
    want = generate(model, ids, **kw)
    reference = [{k: copy.deepcopy(v) for k, v in s.items()} for s in engine_for(model).cache.states]
    stats = {}
    got = generate(model, ids, speculate=methods(model)["draft_model"], speculation_stats=stats, **kw)
    assert torch.equal(got, want) and 0 < stats["accepted"] < stats["drafted"]
    for state, ref in zip(engine_for(model).cache.states, reference):
        if "lengths" in state:  # attention: the rows' lengths (the keys below them are the same tokens')
            assert torch.equal(state["lengths"][:3], ref["lengths"][:3])
            continue
        torch.testing.assert_close(state["recurrent_state"][:3], ref["recurrent_state"][:3], rtol=1e-4, atol=1e-5)
        for conv, conv_ref in zip(state["conv_state"], ref["conv_state"]):
            torch.testing.assert_close(conv[:3], conv_ref[:3], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("verify_cost", [1, None, 1000])  # 1000: inside a run of plain steps
def test_a_stop_token_inside_an_accepted_run_ends_the_row_there(method, verify_cost):
    model = looping("tiny-efla")
    ids, mask = ragged_batch([9, 4, 6, 1])
    free = generate(model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[])
    stop = int(free[2, 9 + 30])  # inside row 2's loop: prompt lookup drafts it in the middle of runs
    want = generate(model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=stop, pad_token_id=0)
    got = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=48,
        eos_token_id=stop,
        pad_token_id=0,
        speculate=methods(model, verify_cost)[method],
    )
    assert torch.equal(got, want)
    assert (want[2, 9:] == stop).any() and want.shape[1] <= 9 + 48


class CountSteps:
    """Counts the engine's plain decoding steps (``DecodeEngine.step``) while installed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = DecodeEngine.step

        def step(engine, *args, **kwargs):
            self.calls += 1
            return original(engine, *args, **kwargs)

        monkeypatch.setattr(DecodeEngine, "step", step)


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-deltanet", "tiny-hybrid-efla"])
@pytest.mark.parametrize("verify_cost", [None, 1000])
def test_turned_down_rounds_take_the_plain_step_and_change_no_token(preset, verify_cost, monkeypatch):
    """With the turn-down rule on (the CPU's default cost, and a cost no pass can pay), rounds without
    a pass worth its time go through the engine's own step: greedy output is still plain greedy's on a
    ragged batch, and every round that did not verify was one engine step."""
    model = looping(preset)
    ids, mask = ragged_batch([9, 4, 6, 1])
    # the prompts end in a first run of the model's looping greedy text: every row has drafts from the start
    ids = generate(model, ids, attention_mask=mask, max_new_tokens=32, eos_token_id=[])
    mask = torch.cat([mask, torch.ones(4, 32, dtype=torch.long)], 1)
    want = generate(model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[])
    steps = CountSteps(monkeypatch)
    stats = {}
    speculate = methods(model, verify_cost)["ngram"]
    got = generate(
        model, ids, attention_mask=mask, max_new_tokens=48, eos_token_id=[], speculate=speculate, speculation_stats=stats
    )
    assert torch.equal(got, want)
    assert steps.calls == stats["rounds"] - stats["verified"] > 0
    if verify_cost == 1000:
        assert stats["verified"] == stats["drafted"] == 0 and stats["rounds"] == 47
    assert stats["verified_rows"] <= stats["verified_tokens"] <= stats["tokens"] == 4 * 48


def test_the_default_rule_verifies_where_a_row_copies_its_prompt(monkeypatch):
    """One row whose prompt ends in the model's looping text: prompt lookup's drafts are kept often
    enough that the CPU's default rule verifies some rounds (several tokens a pass) and steps others."""
    model = looping("tiny-efla")
    ids = generate(model, torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(1)), max_new_tokens=96)
    want = generate(model, ids, max_new_tokens=96, eos_token_id=[])
    steps = CountSteps(monkeypatch)
    stats = {}
    got = generate(model, ids, max_new_tokens=96, eos_token_id=[], speculate={"method": "ngram"}, speculation_stats=stats)
    assert torch.equal(got, want)
    assert stats["verified"] > 0 and steps.calls == stats["rounds"] - stats["verified"] > 0
    assert stats["verified_tokens"] > 2 * stats["verified"] and stats["rounds"] < 95


def test_a_round_with_no_draft_anywhere_is_a_plain_step_even_when_verifying_always_pays(monkeypatch):
    """Random prompts of a large vocabulary: prompt lookup (pairs of tokens) finds nothing for a while,
    and those rounds are engine steps although ``verify_cost=1`` would verify any draft."""
    model = looping("tiny-efla")
    ids = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(5))
    want = generate(model, ids, max_new_tokens=24, eos_token_id=[])
    steps = CountSteps(monkeypatch)
    stats = {}
    speculate = {"method": "ngram", "prompt_lookup_min": 2, "verify_cost": 1}
    got = generate(model, ids, max_new_tokens=24, eos_token_id=[], speculate=speculate, speculation_stats=stats)
    assert torch.equal(got, want)
    assert steps.calls == stats["rounds"] - stats["verified"] > 0


def test_the_turn_down_rule_weighs_expected_tokens_against_the_pass_cost():
    keeps, rejects = speculative._RowSchedule(4), speculative._RowSchedule(4)
    for _ in range(30):
        keeps.observe(4, 4)
        rejects.observe(2, 0)
    assert keeps.expected_kept(4) > 3.5 and rejects.expected_kept(4) < 0.2
    schedules = {0: keeps, 1: rejects}
    pays = speculative._verification_pays
    one_unfed = {0: [7], 1: [7]}
    assert pays(schedules, [0], one_unfed, [4], cost=2.5, adaptive=True)
    assert not pays(schedules, [1], one_unfed, [4], cost=2.5, adaptive=True)
    assert pays(schedules, [1], one_unfed, [4], cost=2.5, adaptive=False)  # no turn-down asked for
    # a batch finishes with its slowest row: rows level with each other all have to expect enough
    assert not pays(schedules, [0, 1], one_unfed, [4, 4], cost=2.5, adaptive=True, room=lambda r: 40, k_max=4)
    # ... but a row far ahead of the others (little room left) does not hold a pass back
    ahead = {0: 40, 1: 10}.get
    assert pays(schedules, [0, 1], one_unfed, [4, 4], cost=2.5, adaptive=True, room=ahead, k_max=4)
    assert not pays(schedules, [0, 1], one_unfed, [4, 4], cost=4.9, adaptive=True, room=ahead, k_max=4)
    assert not pays(schedules, [0, 1], one_unfed, [0, 0], cost=1.0, adaptive=True)  # no draft: nothing to verify
    assert pays(schedules, [1], {1: [7, 8]}, [0], cost=2.5, adaptive=True)  # unfed tokens: a pass runs anyway


def test_a_turned_down_rows_rate_drifts_back_to_the_start_so_it_is_tried_again():
    row = speculative._RowSchedule(4)
    start = row.expected_kept(1)
    for _ in range(20):
        row.observe(1, 0)
    assert row.expected_kept(1) < 0.2 < start
    for _ in range(200):
        row.observe(0, 0)  # plain rounds with no evidence
    assert row.expected_kept(1) == pytest.approx(start, abs=1e-3)
    assert start == pytest.approx(2 / 3)


def test_streamer_gets_the_returned_tokens_column_by_column():
    class Collect:
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ended = True

    model = looping("tiny-efla")
    ids, mask = ragged_batch([5, 3])
    streamer = Collect()
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], speculate={"method": "ngram"}, streamer=streamer
    )
    assert torch.equal(streamer.puts[0], ids) and streamer.ended
    assert torch.equal(torch.stack(streamer.puts[1:], 1), out[:, 5:])


def test_bad_speculation_settings_name_themselves():
    model = looping("tiny-efla")
    ids = torch.randint(3, 256, (1, 4))
    other_vocab = looping("tiny-efla", vocab_size=128)
    for speculate, match in (
        ({"method": "medusa"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "k": 4}, "unknown keys"),
        ({"method": "ngram", "verify_cost": 0.5}, "verify_cost"),
        ({"method": "ngram", "verify_cost": True}, "verify_cost"),
        ({"method": "draft_model"}, "draft model"),
        ({"method": "draft_model", "model": model}, "itself"),
        ({"method": "draft_model", "model": other_vocab}, "vocabulary"),
        ("ngram", "expected None, a dict"),
    ):
        with pytest.raises(ValueError, match=match):
            generate(model, ids, max_new_tokens=4, speculate=speculate)


# -- sampling: the distribution of the first tokens against the target's, by enumeration ---------------

VOCAB, NEW, ROWS = 8, 4, 2000


def prompt_for(model):
    """Every token once (prompt lookup always finds a draft), then the model's greedy continuation
    of them: the drafts are then tokens the model finds likely but not certain (see
    ``residual_mistake_size``)."""
    start = list(range(VOCAB))
    return start + generate(model, torch.tensor([start]), max_new_tokens=6, eos_token_id=[])[0, VOCAB:].tolist()


def residual_mistake_size(model, prompt):
    """The total-variation distance by which drawing a rejected n-gram draft's replacement from ``p``
    instead of ``p`` without the draft moves the second token: ``sum p(t1) p(d) (1 - p(d))`` over the
    first token ``t1`` with its draft ``d``."""
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        rows = torch.cat([torch.tensor(prompt).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        second = model(rows).logits[:, -1].softmax(-1)
    total = 0.0
    for t1 in range(VOCAB):
        draft = speculative._NgramIndex(prompt + [t1], range(1, 4)).propose(1)[0]
        total += float(first[t1] * second[t1, draft] * (1 - second[t1, draft]))
    return total


def exact_marginals(model, prompt):
    """``[NEW, VOCAB]``: the probability of each token at each of the first ``NEW`` new positions under
    the target's own sampling (temperature 1), summed over all ``VOCAB ** NEW`` continuations."""
    rows = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    ids = torch.cat([torch.tensor(prompt).expand(len(rows), -1), rows], 1)
    with torch.no_grad():
        logp = model(ids).logits[:, len(prompt) - 1 : -1].double().log_softmax(-1)
    joint = logp.gather(-1, rows[..., None])[..., 0].sum(1).exp()
    return torch.stack([torch.zeros(VOCAB, dtype=torch.float64).index_add_(0, rows[:, i], joint) for i in range(NEW)])


def chi_square_p_value(counts, probs):
    """The p-value of Pearson's test of ``counts`` against ``probs`` (cells expected below 5 pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    expected = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    statistic = float(((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum())
    dof = len(observed) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64))
    )


def sampled_p_values(case, speculate):
    model, prompt, probs = case["target"], case["prompt"], case["probs"]
    ids = torch.tensor([prompt]).expand(ROWS, -1)
    out = generate(model, ids, max_new_tokens=NEW, temperature=1.0, eos_token_id=[], seed=list(range(ROWS)), speculate=speculate)
    counts = [torch.bincount(out[:, len(prompt) + i], minlength=VOCAB).double() for i in range(NEW)]
    return [chi_square_p_value(c, p) for c, p in zip(counts, probs)]


def always_accept(p, q, drafts, generator):
    return len(drafts), speculative._draw(p[len(drafts)], generator)


def residual_from_p(p, q, drafts, generator):
    """Accepts correctly but on a rejection draws from ``p`` instead of ``norm(max(p - q, 0))``."""
    for j, x in enumerate(drafts):
        q_x = 1.0 if q is None else float(q[j, x])
        if speculative._uniform(generator) * q_x >= float(p[j, x]):
            return j, speculative._draw(p[j], generator)
    return len(drafts), speculative._draw(p[len(drafts)], generator)


@pytest.fixture(scope="module")
def case():
    """A target and a draft model of a vocabulary of 8 (different random weights), the prompt, and
    the target's exact distribution of each new position."""
    target = looping("tiny-efla", seed=0, vocab_size=VOCAB, initializer_range=0.3)
    draft = looping("tiny-efla", seed=1, vocab_size=VOCAB, initializer_range=0.3)
    prompt = prompt_for(target)
    return {"target": target, "draft": draft, "prompt": prompt, "probs": exact_marginals(target, prompt)}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("rule", ["correct", "always_accept", "residual_from_p"])
def test_sampled_tokens_follow_the_target_distribution(method, rule, case, monkeypatch):
    """2000 rows of one prompt, each with its own seed, sample 4 tokens with speculation; each
    position's token counts are tested against the exact distribution (enumerated) with Pearson's
    chi-square. Position 1 comes from the prefill; positions 2-4 from a verification pass of 2 drafts
    (n-gram drafts: point masses on tokens of the prompt; draft model: a different random model's
    distribution) and the passes after it. A correct rule passes at p > 1e-4 on every
    position (a false alarm has probability < 4e-4). The deliberately wrong rules, put in the
    module's place for the rule, move a position's distribution by a total-variation distance ``d`` of
    about 0.1 or more; Pearson's statistic then grows by about ``N * (2 d)^2 >= 80`` (Cauchy-Schwarz),
    against a 1e-6 threshold near 40 for 7 degrees of freedom: they fail with near certainty."""
    assert residual_mistake_size(case["target"], case["prompt"]) > 0.1  # the power argument's premise
    if rule != "correct":
        monkeypatch.setattr(
            speculative, "_accept_sampled", {"always_accept": always_accept, "residual_from_p": residual_from_p}[rule]
        )
    speculate = {"method": method, "num_speculative_tokens": 3, "verify_cost": 1}  # verify every round with a draft
    if method == "draft_model":
        speculate["model"] = case["draft"]
    else:
        speculate["prompt_lookup_min"] = 1  # every token is in the prompt: always a draft
    p_values = sampled_p_values(case, speculate)
    if rule == "correct":
        assert min(p_values) > 1e-4, p_values
    else:
        assert p_values[0] > 1e-4 and min(p_values[1:]) < 1e-6, p_values


def test_sampled_tokens_of_plain_steps_follow_the_target_distribution(case):
    """Every round turned down (``verify_cost=1000``): the tokens come from runs of the engine's step,
    each row drawing with its own generator, and still follow the target's distribution."""
    speculate = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "verify_cost": 1000}
    assert min(sampled_p_values(case, speculate)) > 1e-4


def test_the_enumerated_distribution_is_the_one_non_speculative_sampling_draws(case):
    """The reference itself: plain sampling's counts pass the same test (and the distribution is far
    from uniform, so the test has something to tell apart)."""
    probs = case["probs"]
    assert torch.allclose(probs.sum(1), torch.ones(NEW, dtype=torch.float64))
    assert float((probs - 1 / VOCAB).abs().sum(1).min()) / 2 > 0.1
    p_values = sampled_p_values(case, None)
    assert min(p_values) > 1e-4 and math.isfinite(sum(p_values))
