"""Speculative decoding in the scheduler (``Scheduler(speculate=...)``, ``efla serve --speculate``) on the
CPU in float32: greedy tokens equal the plain server's for a batch of prompts of different lengths
(drafts kept and rejected), from the prefix cache, for n > 1 choices, with a draft model and with a
hybrid model; stop tokens, stop strings and max_tokens inside an accepted run end the request at
the right token; requests with logit processors or log-probabilities get the plain server's tokens
(and log-probabilities); streaming and /metrics over HTTP; sampling is seeded per request and its
filters are applied at every drafted position. The default ``verify_cost`` rule verifies streams
that copy their prompts and steps free text, weighs the requests furthest behind, and lets plain
steps' scored drafts bring a turned-down request back."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from efla.serving import FinishEvent, PrefixCache, SamplingParams, Scheduler, TokenEvent

from .conftest import MODEL_NAME, http_stack, serve

EOS = 2
# verify_cost=1: every round with a draft verifies it, so drafts are kept and rejected (the default
# turns rounds down where acceptance is low: its own tests below)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "verify_cost": 1}


def _model(preset: str = "tiny-efla"):
    """A random model: its greedy text falls into loops, so prompt lookup's drafts are often right
    (and sometimes wrong)."""
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config(preset)).eval()


def _draft_of(model, scale: float = 0.1):
    """A draft model that agrees with ``model`` often but not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std().nan_to_num(0) * torch.randn(p.shape, generator=generator))
    return draft


def _prompts(lengths=(5, 30, 12, 1, 60, 9), seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]


class _Events:
    def __init__(self):
        self.by_request: dict[int, list] = {}
        self.lock = threading.Lock()
        self.ended = threading.Semaphore(0)

    def __call__(self, request, event) -> None:
        with self.lock:
            self.by_request.setdefault(id(request), []).append(event)
        if not isinstance(event, TokenEvent):
            self.ended.release()


def _serve(model, submissions, tokenizer=None, stop_tokens=(EOS,), choices: int = 1, **options):
    """Run ``submissions`` (``(prompt, SamplingParams)``, all submitted at once) on a scheduler of 4
    slots; the requests, their events and the scheduler's status at the end."""
    scheduler = Scheduler(model, tokenizer, stop_tokens=list(stop_tokens), **{"max_batch": 4, "max_context": 1024, **options})
    scheduler.start()
    events = _Events()
    try:
        requests = [r for prompt, params in submissions for r in scheduler.submit([prompt], params, events, choices)]
        for _ in requests:
            assert events.ended.acquire(timeout=120), "a request did not end"
        status = scheduler.status()
        if scheduler.speculation is not None:  # ended requests leave nothing behind
            assert not (scheduler.speculation.unfed or scheduler.speculation.requests or scheduler.speculation.indexes)
    finally:
        scheduler.close(30)
    for request in requests:
        assert isinstance(events.by_request[id(request)][-1], FinishEvent), events.by_request[id(request)][-1]
    return requests, events, status


def _both(model, submissions, speculate=NGRAM, **options):
    """The plain server's requests and the speculating server's, and the latter's speculation counts."""
    plain, _, _ = _serve(model, submissions, **options)
    speculative, _, status = _serve(model, submissions, speculate=speculate, **options)
    return plain, speculative, status["speculation"]


def _kept_and_rejected(counts: dict) -> None:
    """Both outcomes happened: drafts kept (a pass worth several tokens) and drafts rejected (rollback)."""
    assert counts["enabled"] and 0 < counts["accepted"] < counts["drafted"], counts


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla", "tiny-hybrid-efla"])
def test_greedy_tokens_equal_the_plain_servers(preset):
    """Six prompts of 1 to 60 tokens on 4 slots (slots reused), 40 tokens each, and some rounds gave
    a request several tokens: fewer rounds than the plain server's steps."""
    model = _model(preset)
    submissions = [(p, SamplingParams(max_tokens=40)) for p in _prompts()]
    plain, speculative, counts = _both(model, submissions, prefill_chunk=16)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert sum(map(len, (r.tokens for r in plain))) > 6 * 20  # the stop token did not end them at once
    _kept_and_rejected(counts)


def test_rows_accept_runs_of_different_lengths_in_one_round(monkeypatch):
    """Within one round, requests take different numbers of tokens (ragged acceptance), and the
    output still equals the plain server's."""
    import efla.serving.speculation as speculation

    taken: list[list[int]] = []
    verify = speculation.SpeculativeRounds.verify

    def recording(self, requests, *args):
        results = verify(self, requests, *args)
        taken.append([len(tokens) for tokens, _ in results])
        return results

    monkeypatch.setattr(speculation.SpeculativeRounds, "verify", recording)
    model = _model()
    submissions = [(p, SamplingParams(max_tokens=40)) for p in _prompts((7, 3, 20, 11))]
    plain, speculative, counts = _both(model, submissions)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert any(len(set(round_)) > 1 for round_ in taken if len(round_) > 1)
    _kept_and_rejected(counts)


def test_greedy_tokens_from_the_prefix_cache_equal_the_plain_servers():
    """Prompts sharing 40-token prefixes: later ones start from a cached state (hits) and speculate
    over their whole prompt."""
    model = _model()
    shared = _prompts((40,), seed=5)[0]
    tails = _prompts((3, 9, 1, 14, 6), seed=6)
    submissions = [(shared + tail, SamplingParams(max_tokens=30)) for tail in tails]
    plain, _, _ = _serve(model, submissions, prefix_cache=PrefixCache(block=8), prefill_chunk=16)
    speculative, _, status = _serve(model, submissions, prefix_cache=PrefixCache(block=8), prefill_chunk=16, speculate=NGRAM)
    assert status["prefix_cache"]["hits"] > 0
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    _kept_and_rejected(status["speculation"])


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-hybrid-efla"])
def test_n_greedy_choices_each_equal_the_plain_servers(preset):
    """n = 3 (forked states; a hybrid model prefills each choice on its own)."""
    model = _model(preset)
    submissions = [(p, SamplingParams(max_tokens=24)) for p in _prompts((6, 15, 30))]
    plain, _, _ = _serve(model, submissions, choices=3, max_batch=9)
    speculative, _, status = _serve(model, submissions, choices=3, max_batch=9, speculate=NGRAM)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert all(r.tokens == speculative[0].tokens for r in speculative[:3])
    _kept_and_rejected(status["speculation"])


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-hybrid-efla"])
def test_a_draft_model_gives_the_plain_servers_greedy_tokens(preset):
    model = _model(preset)
    submissions = [(p, SamplingParams(max_tokens=32)) for p in _prompts()]
    speculate = {"method": "draft_model", "model": _draft_of(model), "num_speculative_tokens": 3, "verify_cost": 1}
    plain, speculative, counts = _both(model, submissions, speculate=speculate, prefill_chunk=16)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    _kept_and_rejected(counts)


def test_a_draft_model_with_n_choices_and_the_prefix_cache():
    """Forked choices get the draft model's state too (each prompt prefilled into the draft pool)."""
    model = _model()
    shared = _prompts((24,), seed=5)[0]
    submissions = [(shared + tail, SamplingParams(max_tokens=20)) for tail in _prompts((2, 7, 4, 9), seed=8)]
    speculate = {"method": "draft_model", "model": _draft_of(model), "num_speculative_tokens": 3, "verify_cost": 1}
    options = {"choices": 2, "prefix_cache": PrefixCache(block=8), "prefill_chunk": 8}
    plain, _, _ = _serve(model, submissions, **options)
    options["prefix_cache"] = PrefixCache(block=8)
    speculative, _, status = _serve(model, submissions, speculate=speculate, **options)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert status["prefix_cache"]["hits"] > 0
    _kept_and_rejected(status["speculation"])


def _recording_runs(monkeypatch) -> dict:
    """Every round's tokens per request (``id(request)``: its runs, in order; a plain step's one token)."""
    import efla.serving.speculation as speculation

    runs: dict[int, list[list[int]]] = {}
    verify, stepped = speculation.SpeculativeRounds.verify, speculation.SpeculativeRounds.stepped

    def verifying(self, requests, *args):
        results = verify(self, requests, *args)
        for request, (tokens, _) in zip(requests, results):
            runs.setdefault(id(request), []).append(tokens)
        return results

    def stepping(self, requests, tokens):
        stepped(self, requests, tokens)
        for request, token in zip(requests, tokens):
            runs.setdefault(id(request), []).append([token])

    monkeypatch.setattr(speculation.SpeculativeRounds, "verify", verifying)
    monkeypatch.setattr(speculation.SpeculativeRounds, "stepped", stepping)
    return runs


def _first_inside_a_run(runs: list[list[int]], first_token: int) -> int | None:
    """A token whose first occurrence in the output is inside a round's run, not at its end."""
    seen = {first_token}
    for run in runs:
        for i, token in enumerate(run):
            if i < len(run) - 1 and token not in seen:
                return token
            seen.add(token)
    return None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stop_tokens_inside_accepted_runs_end_requests_at_the_right_token(monkeypatch, method):
    """A stop token whose first occurrence the speculating server produced inside a round's run
    (drafts kept after it): the request ends at it, with the plain server's tokens, and the run's
    tokens after it are dropped. The prompts hold the model's own loop, which prompt lookup drafts
    from before the output repeats itself."""
    runs = _recording_runs(monkeypatch)
    model = _model()
    speculate = NGRAM if method == "ngram" else {"method": "draft_model", "model": _draft_of(model), "verify_cost": 1}
    bases = _prompts((7, 3, 20, 11))
    looped, _, _ = _serve(model, [(p, SamplingParams(max_tokens=30)) for p in bases], stop_tokens=())
    prompts = [p + r.tokens for p, r in zip(bases, looped)]
    free, _, _ = _serve(model, [(p, SamplingParams(max_tokens=40)) for p in prompts], stop_tokens=(), speculate=speculate)
    stops = {i: _first_inside_a_run(runs[id(r)], r.tokens[0]) for i, r in enumerate(free)}
    stops = {i: stop for i, stop in stops.items() if stop is not None}
    assert stops, "no run of several tokens"
    submissions = [(prompts[i], SamplingParams(max_tokens=40, stop_token_ids=(stop,))) for i, stop in stops.items()]
    plain, plain_events, _ = _serve(model, submissions, stop_tokens=())
    speculative, events, status = _serve(model, submissions, stop_tokens=(), speculate=speculate)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    for request, stop in zip(speculative, stops.values()):
        assert request.tokens[-1] == stop and stop not in request.tokens[:-1]
        assert events.by_request[id(request)][-1].reason == "stop"
        assert sum(map(len, runs[id(request)])) + 1 > len(request.tokens)  # + 1: the first token, from prefill
    assert status["tokens_generated"] == sum(len(r.tokens) for r in speculative)


def test_max_tokens_ends_requests_at_the_right_token():
    """Drafts stop short of max_tokens (a round's last token is at most the request's last): every
    length from 1 to 38 gives the plain server's tokens."""
    model = _model()
    prompts = _prompts((7, 3, 20, 11))
    lengths = [1, 2, 3, 5, 8, 13, 17, 21, 26, 29, 33, 38]
    submissions = [(prompts[i % 4], SamplingParams(max_tokens=m)) for i, m in enumerate(lengths)]
    plain, speculative, counts = _both(model, submissions, stop_tokens=())
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert [len(r.tokens) for r in speculative] == lengths
    _kept_and_rejected(counts)


def _stop_string_inside_a_run(tokenizer, tokens: list[int], runs: list[list[int]]) -> str | None:
    """A 3-character string of the text of ``tokens`` that the server's stop-string check finds at a
    token inside a round's run (not its last)."""
    from efla.serving.completion_text import CompletionText

    inside, position = set(), 1  # the first token comes from the prefill
    for run in runs:
        inside.update(range(position, position + len(run) - 1))
        position += len(run)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for start in range(len(text) - 2):
        stop = text[start : start + 3]
        if not (stop.isprintable() and stop.strip()) or "\ufffd" in stop:
            continue
        completion = CompletionText(tokenizer, [stop])
        at = next((i for i, token in enumerate(tokens) if completion.add(token) or completion.stopped), None)
        if at in inside:
            return stop
    return None


def test_stop_strings_inside_accepted_runs_end_the_text_where_the_plain_servers_does(loaded, monkeypatch):
    """A stop string completed inside a round's run: the plain server's tokens and text, the stop
    string not shown, the run's tokens after it dropped."""
    runs = _recording_runs(monkeypatch)
    model, tokenizer = loaded
    base = tokenizer("def main(self):\n    return self.main(self)\n")["input_ids"]
    looped, _, _ = _serve(model, [(base, SamplingParams(max_tokens=40))], tokenizer, stop_tokens=())
    prompt = base + looped[0].tokens  # the model's own loop, which prompt lookup drafts from the start
    free, _, _ = _serve(model, [(prompt, SamplingParams(max_tokens=48))], tokenizer, stop_tokens=(), speculate=NGRAM)
    stop = _stop_string_inside_a_run(tokenizer, free[0].tokens, runs[id(free[0])])
    assert stop is not None, "no stop string inside a run"
    submissions = [(prompt, SamplingParams(max_tokens=48, stop=(stop,))), (prompt[:5], SamplingParams(max_tokens=48))]
    plain, plain_events, _ = _serve(model, submissions, tokenizer, stop_tokens=())
    speculative, events, status = _serve(model, submissions, tokenizer, stop_tokens=(), speculate=NGRAM)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert len(plain[0].tokens) < 48
    assert sum(map(len, runs[id(speculative[0])])) + 1 > len(speculative[0].tokens)  # tokens after the end dropped

    def text_of(ev, request):
        return "".join(e.text for e in ev.by_request[id(request)])

    assert [text_of(events, r) for r in speculative] == [text_of(plain_events, r) for r in plain]
    assert stop not in text_of(events, speculative[0]) and events.by_request[id(speculative[0])][-1].reason == "stop"
    assert status["speculation"]["accepted"] > 0


def test_processor_and_logprob_requests_get_the_plain_servers_tokens_and_logprobs():
    """Requests with processors decode without drafts beside speculating ones; log-probabilities of
    every kept token (drafted or not) are the plain step's, to float32 rounding of chunked sums."""
    model = _model()
    prompts = _prompts((7, 3, 20, 11))
    submissions = [
        (prompts[0], SamplingParams(max_tokens=30, repetition_penalty=1.3, logit_bias=((5, 3.0),))),
        (prompts[1], SamplingParams(max_tokens=30, min_tokens=10, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=30, logprobs=3)),
        (prompts[3], SamplingParams(max_tokens=30)),
    ]
    plain, plain_events, _ = _serve(model, submissions)
    speculative, events, status = _serve(model, submissions, speculate=NGRAM)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]

    def logprobs(ev, request):
        return [lp for e in ev.by_request[id(request)] for lp in e.logprobs]

    want, got = logprobs(plain_events, plain[2]), logprobs(events, speculative[2])
    assert [lp.token for lp in got] == plain[2].tokens == [lp.token for lp in want]
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in got]), torch.tensor([lp.logprob for lp in want]), rtol=0, atol=1e-4
    )
    assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want]
    _kept_and_rejected(status["speculation"])


def test_requests_with_processors_alone_draft_nothing():
    model = _model()
    submissions = [(p, SamplingParams(max_tokens=20, frequency_penalty=0.5)) for p in _prompts((7, 3))]
    plain, speculative, counts = _both(model, submissions)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert counts["drafted"] == 0 and counts["rounds"] > 0


def test_top_k_1_sampling_gives_greedy_tokens_through_the_rejection_rule():
    """Sampling whose filters leave one token: drafted positions are filtered with the request's own
    settings, so the tokens are the greedy ones (a draft checked against unfiltered probabilities
    would be kept at random)."""
    model = _model()
    prompts = _prompts((7, 3, 20, 11))
    greedy, _, _ = _serve(model, [(p, SamplingParams(max_tokens=30)) for p in prompts])
    sampled = [(p, SamplingParams(max_tokens=30, temperature=1.5, top_k=1)) for p in prompts]
    speculative, _, status = _serve(model, sampled, speculate=NGRAM)
    assert [r.tokens for r in speculative] == [r.tokens for r in greedy]
    _kept_and_rejected(status["speculation"])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_seeded_sampling_request_gives_the_same_tokens_alone_and_beside_others(method):
    model = _model()
    speculate = NGRAM if method == "ngram" else {"method": "draft_model", "model": _draft_of(model), "verify_cost": 1}
    prompts = _prompts((7, 3, 20, 11))
    seeded = (prompts[0], SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=11))
    alone, _, _ = _serve(model, [seeded], speculate=speculate)
    others = [(p, SamplingParams(max_tokens=30, temperature=0.9)) for p in prompts[1:]]
    beside, _, status = _serve(model, [*others, seeded], speculate=speculate)
    assert beside[-1].tokens == alone[0].tokens and len(alone[0].tokens) > 1
    assert status["speculation"]["drafted"] > 0


def test_sampled_sequences_follow_the_plain_servers_distribution():
    """Three tokens at temperature 1 from the two likeliest at each position (at most 8 sequences):
    600 draws from each server, a chi-square test of homogeneity (a rule that kept every draft, or
    drew its correction from ``p`` without removing the draft, would fail it: prompt lookup drafts
    the looping continuation far more often than the model picks it)."""
    from scipy.stats import chi2_contingency

    model = _model()
    base = _prompts((7,))[0]
    free, _, _ = _serve(model, [(base, SamplingParams(max_tokens=40))])
    prompt = base + free[0].tokens  # the model's own loop: prompt lookup drafts its likely continuation
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2)
    counts = []
    for speculate in (None, NGRAM):
        requests, _, status = _serve(
            model, [(prompt, params)] * 100, choices=6, max_batch=16, max_queue=1024, seed=0, speculate=speculate
        )
        sequences = [tuple(r.tokens) for r in requests]
        counts.append({s: sequences.count(s) for s in set(sequences)})
    if status["speculation"]["drafted"] == 0:
        pytest.fail("nothing was drafted: the test checks nothing")
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(k, 0) for k in keys] for c in counts]
    assert len(keys) > 2
    assert chi2_contingency(table).pvalue > 1e-3, table


def test_over_http_streams_join_to_the_plain_servers_text_and_metrics_count_drafts(server, loaded):
    """A speculating server's streamed and plain completions (several prompts at once, one with n =
    2 and a stop string) are the plain server's texts; /metrics and /health count its drafts."""
    http_stack()
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    prompts = ["def main(self):\n    return self.main(", "import torch\nimport torch", "class EFLA"]
    plain = server.client().completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=40, temperature=0, n=2, stop=["):"])
    with serve(*loaded, speculate=NGRAM) as served:
        client = served.client()
        got = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=40, temperature=0, n=2, stop=["):"])
        assert [(c.text, c.finish_reason) for c in got.choices] == [(c.text, c.finish_reason) for c in plain.choices]
        for i, prompt in enumerate(prompts):
            chunks = list(
                client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=["):"], stream=True)
            )
            assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks) == plain.choices[2 * i].text
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
        health = served.health()
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    counts = health["speculation"]
    assert samples["efla_spec_draft_tokens_total"] == counts["drafted"] > 0
    assert samples["efla_spec_accepted_tokens_total"] == counts["accepted"] > 0
    assert samples["efla_spec_rounds_total"] == counts["rounds"] > 0
    assert samples["efla_spec_verified_rounds_total"] == counts["verified"] > 0
    assert "efla_spec_draft_tokens_total" not in httpx.get(f"{server.url}/metrics", timeout=10).text


def test_structured_requests_beside_speculating_ones_follow_their_schema_and_keep_the_plain_tokens(server, loaded):
    """A grammar's request takes no drafts but its matcher sees each of its tokens once: greedy, the
    plain server's tokens; greedy and sampled, a valid value. The free request beside it speculates."""
    pytest.importorskip("xgrammar")
    import json

    from efla.serving.structured import Grammars

    model, tokenizer = loaded
    grammar = Grammars(tokenizer, model.get_output_embeddings().out_features, [tokenizer.eos_token_id]).compile(
        {"type": "json_object"}
    )
    prompt = tokenizer("def forward(self, x):")["input_ids"]
    submissions = [
        (prompt, SamplingParams(max_tokens=120, grammar=grammar)),
        (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=3, grammar=grammar)),
        (tokenizer("import torch\nimport torch")["input_ids"], SamplingParams(max_tokens=40)),
    ]
    plain, _, _ = _serve(model, submissions, tokenizer, stop_tokens=(tokenizer.eos_token_id,))
    speculative, _, status = _serve(model, submissions, tokenizer, stop_tokens=(tokenizer.eos_token_id,), speculate=NGRAM)
    assert [speculative[i].tokens for i in (0, 2)] == [plain[i].tokens for i in (0, 2)]  # the greedy ones
    for request in speculative[:2]:
        assert request.tokens[-1] == tokenizer.eos_token_id
        assert isinstance(json.loads(tokenizer.decode(request.tokens[:-1])), dict)
    assert status["speculation"]["drafted"] > 0


# -- the turn-down rule (the default verify_cost) ----------------------------------------------------------


def _rounds(slots: int = 4):
    """The speculative state of a scheduler's ``slots`` with prompt lookup and the default cost."""
    from efla.generation.engine import DecodeEngine
    from efla.generation.speculative import speculative_config
    from efla.serving.speculation import SpeculativeRounds

    model = _model()
    return SpeculativeRounds(speculative_config({"method": "ngram"}), model, DecodeEngine(model), slots, 256)


def _joined(rounds, slot: int, prompt: list[int], first_token: int):
    from efla.serving.requests import Request

    request = Request(prompt, SamplingParams(max_tokens=200), lambda *_: None, slot=slot)
    rounds.join(request, first_token)
    return request


def test_a_pass_pays_where_every_request_furthest_behind_expects_the_cost():
    """``generate``'s rule over the scheduler's requests: a request whose drafts are kept verifies; one
    whose drafts are rejected (or who has none) beside it holds the pass back, unless it is far
    ahead (little of its ``max_tokens`` left to go); no draft, no pass; no turn-down asked for."""
    rounds = _rounds()
    requests = [_joined(rounds, slot, [5, 6, 7], 8) for slot in range(2)]
    for _ in range(30):
        rounds.schedules[0].observe(4, 4)
        rounds.schedules[1].observe(2, 0)
    keeps, rejects = requests
    assert rounds._pass_pays([keeps], [4])
    assert not rounds._pass_pays([rejects], [4])
    assert not rounds._pass_pays([keeps, rejects], [4, 4])
    assert not rounds._pass_pays([keeps, rejects], [4, 0])
    assert not rounds._pass_pays([keeps, rejects], [0, 0])  # no draft: nothing to verify
    rejects.tokens = [9] * 190  # 10 tokens to go, the other 200: it does not hold the pass back
    assert rounds._pass_pays([keeps, rejects], [4, 4])
    keeps.tokens = [9] * 195
    assert not rounds._pass_pays([keeps, rejects], [4, 4])  # level again (within k = 4 tokens)


def test_plain_steps_score_the_first_draft_so_a_turned_down_request_returns_where_its_text_repeats():
    """A request whose drafts were rejected is turned down; plain steps whose token equals prompt
    lookup's first draft (a text repeating itself) bring its rate back within sixteen steps, steps
    whose token is another of the text's tokens (drafts, all rejected) do not."""
    outcomes = {}
    for follows_the_draft in (True, False):
        rounds = _rounds()
        request = _joined(rounds, 0, [5, 6, 7, 5, 6, 7, 5, 6], 7)
        for _ in range(20):
            rounds.schedules[0].observe(1, 0)
        verifies, drafted = [], 0
        for _ in range(16):
            drafts, _, verify = rounds.propose([request], torch.Generator())
            verifies.append(verify)
            first = drafts[0][0] if drafts[0] else 7
            drafted += bool(drafts[0])
            rounds.stepped([request], [first if follows_the_draft else 5 + (first - 4) % 3])
        outcomes[follows_the_draft] = verifies + [rounds.propose([request], torch.Generator())[2]]
        assert drafted > 8
    assert not any(outcomes[True][:3]) and outcomes[True][-1]
    assert not any(outcomes[False])


# one stream; four on four slots; four on two (requests wait for a slot and join as others end)
@pytest.mark.parametrize(("streams", "max_batch"), [(1, 4), (4, 4), (4, 2)])
def test_the_default_rule_verifies_streams_that_copy_their_prompts(monkeypatch, streams, max_batch):
    """Greedy requests whose prompts end in the model's looping text: the default rule verifies some
    rounds, worth more than two tokens a pass on average, and steps the others, feeding a slot's kept
    tokens first where a turned-down round follows a rejection; the tokens are the plain server's."""
    import efla.serving.speculation as speculation

    fed = []
    feed = speculation._feed_all_but_last

    def feeding(engine, unfed, rows):
        fed.extend(r for r in rows if len(unfed[r]) > 1)
        feed(engine, unfed, rows)

    monkeypatch.setattr(speculation, "_feed_all_but_last", feeding)
    model = _model()
    bases = _prompts((32, 20, 9, 27)[:streams])
    looped, _, _ = _serve(model, [(p, SamplingParams(max_tokens=96)) for p in bases], stop_tokens=())
    submissions = [(p + r.tokens, SamplingParams(max_tokens=96)) for p, r in zip(bases, looped)]
    options = {"speculate": {"method": "ngram"}, "stop_tokens": (), "max_batch": max_batch}
    plain, speculative, counts = _both(model, submissions, **options)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    assert 0 < counts["verified"] < counts["rounds"]
    assert counts["accepted"] > counts["verified"]  # more than two tokens a pass on average
    assert fed


def test_free_sampled_text_takes_plain_steps_under_the_default_rule():
    """Four requests sampling freely from random prompts, prompt lookup matching single tokens (so
    there are drafts, nearly all rejected): verifying every draft runs many passes; the default rule
    turns them down to plain steps."""
    model = _model()
    submissions = [(p, SamplingParams(max_tokens=60, temperature=1.0, seed=i)) for i, p in enumerate(_prompts((20,) * 4, seed=5))]
    counts = {}
    for cost in (1, None):
        speculate = {"method": "ngram", "prompt_lookup_min": 1, "verify_cost": cost}
        _, _, status = _serve(model, submissions, speculate=speculate, stop_tokens=())
        counts[cost] = status["speculation"]
    assert counts[1]["verified"] > counts[1]["rounds"] / 4 and counts[1]["accepted"] < counts[1]["drafted"] / 4
    assert counts[None]["verified"] <= counts[None]["rounds"] / 10
