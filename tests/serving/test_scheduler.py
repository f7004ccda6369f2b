"""The scheduler without HTTP: chunked prefill gives generate's tokens for every kind of model, a long
prompt's prefill lets running requests go on step by step, a failed step ends only its requests, and
cancelled requests, waiting or running, end and give their places back."""

from __future__ import annotations

import threading

import pytest
import torch

from efla.generation import generate
from efla.serving import ErrorEvent, FinishEvent, PrefixCache, SamplingParams, Scheduler, TokenEvent

EOS = 2


class Collector:
    """``on_event`` for a scheduler: keeps every event in order and signals when ``expected`` requests ended."""

    def __init__(self, expected: int):
        self.events: list[tuple[object, object]] = []
        self.ended = 0
        self.expected = expected
        self.all_ended = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, request, event) -> None:
        with self.lock:
            self.events.append((request, event))
            if isinstance(event, (FinishEvent, ErrorEvent)):
                self.ended += 1
                if self.ended == self.expected:
                    self.all_ended.set()

    def wait(self) -> None:
        assert self.all_ended.wait(60), f"{self.ended} of {self.expected} requests ended"

    def final(self, request):
        return next(e for r, e in self.events if r is request and isinstance(e, (FinishEvent, ErrorEvent)))


def _model(preset: str):
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config(preset)).eval()


def _generate_alone(model, prompt: list[int], max_tokens: int, **sampling) -> list[int]:
    out = generate(model, torch.tensor([prompt]), max_new_tokens=max_tokens, eos_token_id=EOS, **sampling)
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


def _scheduler(model, **options) -> Scheduler:
    scheduler = Scheduler(model, None, stop_tokens=[EOS], **{"max_batch": 4, "max_context": 1024, **options})
    scheduler.start()
    return scheduler


def _served_as_alone(scheduler: Scheduler, prompts: list[list[int]], expected: list[list[int]]) -> dict:
    """Submit every prompt at once (10 new tokens each) to a scheduler of 4 slots; each gets
    ``expected``'s tokens, every slot is free again and every prompt token was prefilled. The status."""
    collector = Collector(len(prompts))
    requests = [scheduler.submit([p], SamplingParams(max_tokens=10), collector)[0] for p in prompts]
    collector.wait()
    assert [r.tokens for r in requests] == expected
    status = scheduler.status()
    assert status["slots_free"] == 4 and status["prompt_tokens_prefilled"] == sum(map(len, prompts))
    return status


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla", "tiny-deltanet", "tiny-hybrid-efla"])
def test_chunked_prefill_gives_generates_tokens(preset):
    """Prompts of 20-150 tokens prefilled 7 tokens per step, each continuing from its slot's state, with
    more prompts than slots (slots are reused): the tokens of generate with each prompt alone."""
    model = _model(preset)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (20, 150, 64, 65, 97, 33)]
    expected = [_generate_alone(model, p, 10) for p in prompts]
    scheduler = _scheduler(model, prefill_chunk=7, prefix_cache=PrefixCache(block=16))
    try:
        status = _served_as_alone(scheduler, prompts, expected)
        assert status["prefix_cache"]["enabled"] is (preset != "tiny-hybrid-efla")
    finally:
        scheduler.close()


def test_with_captured_steps_prompts_share_prefill_calls_and_give_generates_tokens(monkeypatch):
    """As on a GPU (a stand-in for CUDA graphs replays the captured steps eagerly): decoding and prefill
    buckets captured at start, pieces of several prompts in one padded call, generate's tokens."""
    from ..generation.test_prefill_rows import _EagerGraph

    model = _model("tiny-efla")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (20, 150, 64, 65, 97, 33, 5)]
    expected = [_generate_alone(model, p, 10) for p in prompts]
    scheduler = Scheduler(model, None, stop_tokens=[EOS], max_batch=4, max_context=1024, prefill_chunk=128)
    scheduler.engine.use_graphs = True
    monkeypatch.setattr(scheduler.engine, "_captured", _EagerGraph)
    scheduler.start()
    try:
        assert sorted(scheduler.engine.prefill_buckets) == [(1, 32), (1, 64), (1, 128), (2, 32), (2, 64), (4, 32)]
        status = _served_as_alone(scheduler, prompts, expected)
        assert status["prefill_calls"] < len(prompts)
    finally:
        scheduler.close()


def test_seeded_requests_decoding_together_sample_as_if_alone(loaded):
    """Three prompts with one seed, admitted and decoded together: each row draws its noise from its
    own generator, so each gives what generate gives it alone with that seed."""
    model = loaded[0]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    sampling = dict(temperature=1.0, top_k=50, top_p=0.9)
    expected = [_generate_alone(model, p, 12, seed=7, **sampling) for p in prompts]
    assert len({tuple(e) for e in expected}) == 3
    scheduler = _scheduler(model)
    try:
        collector = Collector(3)
        requests = scheduler.submit(prompts, SamplingParams(max_tokens=12, seed=7, **sampling), collector)
        collector.wait()
        assert scheduler.peak_batch == 3
        assert [r.tokens for r in requests] == expected
    finally:
        scheduler.close()


def _running_request(scheduler: Scheduler, collector: Collector, max_tokens: int):
    """A request that has made its first token, and the number of events until then."""
    running = scheduler.submit([[5, 6, 7]], SamplingParams(max_tokens=max_tokens), collector)[0]
    while not any(r is running for r, _ in list(collector.events)):
        threading.Event().wait(0.001)
    return running, len(collector.events)


def _tokens_before(collector: Collector, start: int, request, running) -> int:
    """Events of ``running`` after event ``start`` and before ``request``'s first one."""
    events = [r for r, _ in collector.events[start:]]
    return events[: events.index(request)].count(running)


def test_a_long_prompt_is_prefilled_between_decoding_steps(loaded):
    """While a 200-token prompt is prefilled 8 tokens per step, a running request gets a token every step."""
    model = loaded[0]
    scheduler = _scheduler(model, prefill_chunk=8)
    try:
        collector = Collector(2)
        running, submitted_at = _running_request(scheduler, collector, max_tokens=60)
        long_prompt = scheduler.submit([list(range(3, 203))], SamplingParams(max_tokens=1), collector)[0]
        collector.wait()
        during_prefill = _tokens_before(collector, submitted_at, long_prompt, running)
        assert during_prefill >= 200 // 8 - 1  # a token of the running request per prefill chunk, less the read lag
        assert collector.final(running).completion_tokens == 60
    finally:
        scheduler.close()


def test_prefill_every_spaces_the_prefill_calls_while_half_the_slots_decode(loaded):
    """One of two slots decoding (half): a 40-token prompt prefilled 8 tokens per call, one call every 5
    steps, so the running request gets 5 tokens per chunk; its tokens are still generate's."""
    model = loaded[0]
    expected = _generate_alone(model, list(range(3, 43)), 3)
    scheduler = _scheduler(model, max_batch=2, prefill_chunk=8, prefill_every=5)
    try:
        collector = Collector(2)
        running, submitted_at = _running_request(scheduler, collector, max_tokens=100)
        calls_before = scheduler.status()["prefill_calls"]
        spaced = scheduler.submit([list(range(3, 43))], SamplingParams(max_tokens=3), collector)[0]
        collector.wait()
        assert _tokens_before(collector, submitted_at, spaced, running) >= (40 // 8 - 1) * 5
        assert scheduler.status()["prefill_calls"] - calls_before == 40 // 8
        assert spaced.tokens == expected
    finally:
        scheduler.close()


def test_a_failed_step_ends_its_requests_and_the_scheduler_goes_on(loaded, monkeypatch):
    model = loaded[0]
    scheduler = _scheduler(model)
    try:
        real_step = scheduler.engine.step
        failures = iter([True])

        def failing_once(*args, **kwargs):
            if next(failures, False):
                raise RuntimeError("a device error")
            return real_step(*args, **kwargs)

        monkeypatch.setattr(scheduler.engine, "step", failing_once)
        collector = Collector(2)
        scheduler.submit([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=5), collector)
        collector.wait()
        assert all(isinstance(e, ErrorEvent) for _, e in collector.events if not isinstance(e, TokenEvent))
        assert scheduler.running and scheduler.status()["slots_free"] == 4
        collector = Collector(1)
        request = scheduler.submit([[5, 6, 7]], SamplingParams(max_tokens=5), collector)[0]
        collector.wait()
        assert request.tokens == _generate_alone(model, [5, 6, 7], 5)
    finally:
        scheduler.close()


def test_cancelled_requests_end_and_give_their_places_back(loaded):
    model = loaded[0]
    scheduler = _scheduler(model, max_batch=1, max_queue=1)
    try:
        collector = Collector(2)
        running, waiting = scheduler.submit([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=500), collector)
        while not running.tokens:
            threading.Event().wait(0.001)
        scheduler.cancel([waiting, running])
        collector.wait()
        assert collector.final(waiting).reason == collector.final(running).reason == "cancelled"
        assert waiting.tokens == [] and len(running.tokens) < 500
        status = scheduler.status()
        assert (status["slots_free"], status["waiting"]) == (1, 0)
        collector = Collector(2)
        scheduler.submit([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3), collector)  # both places free again
        collector.wait()
    finally:
        scheduler.close()


def test_closing_ends_queued_and_running_requests_with_an_error(loaded):
    scheduler = _scheduler(loaded[0], max_batch=1)
    collector = Collector(2)
    running, _ = scheduler.submit([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=900), collector)
    while not running.tokens:
        threading.Event().wait(0.001)
    scheduler.close()
    collector.wait()
    assert not scheduler.running
    assert [e.message for _, e in collector.events if isinstance(e, ErrorEvent)] == ["the server is shutting down"] * 2


def test_prefill_settings_default_by_device_and_give_way_to_the_callers(loaded):
    """Small prefill calls between every two steps (a GPU's take several full rows: its captured
    calls cost their GPU time); settings passed in win."""
    from efla.serving import prefill_defaults
    from efla.serving.prefill import ROW_TOKENS

    assert prefill_defaults(torch.device("cpu")) == (512, 1)
    chunk, every = prefill_defaults(torch.device("cuda"))
    assert chunk >= 4 * ROW_TOKENS and every == 1
    by_default = Scheduler(loaded[0], None, max_batch=2, max_context=64)
    chosen = Scheduler(loaded[0], None, max_batch=2, max_context=64, prefill_chunk=7, prefill_every=3)
    assert (by_default.prefill_chunk, by_default.prefill_every) == (512, 1)
    assert (chosen.prefill_chunk, chosen.prefill_every) == (7, 3)


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla", "tiny-deltanet", "tiny-hybrid-efla"])
def test_forked_choices_give_generates_tokens_and_the_models_log_probabilities(preset):
    """n = 3 greedy choices per prompt: one prefill whose state the other choices copy (a hybrid model
    prefills each), generate's tokens; the log-probabilities of the steps and of the prompt are the
    model's forward's, float32."""
    model = _model(preset)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (37, 70)]
    scheduler = _scheduler(model, max_batch=8, prefill_chunk=16, prefix_cache=PrefixCache(block=16))
    try:
        collector = Collector(6)
        requests = scheduler.submit(prompts, SamplingParams(max_tokens=10, logprobs=2, prompt_logprobs=1), collector, 3)
        collector.wait()
        copies = 3 if preset == "tiny-hybrid-efla" else 1
        assert scheduler.status()["prompt_tokens_prefilled"] == copies * sum(map(len, prompts))
        assert scheduler.status()["slots_free"] == 8
    finally:
        scheduler.close()
    for i, request in enumerate(requests):
        prompt = prompts[i // 3]
        assert request.tokens == _generate_alone(model, prompt, 10)
        with torch.no_grad():
            expected = model(torch.tensor([prompt + request.tokens])).logits[0].float().log_softmax(-1)
        entries = [entry for r, event in collector.events if r is request for entry in event.logprobs]
        assert [e.token for e in entries] == request.tokens
        want = [expected[len(prompt) - 1 + j, t].item() for j, t in enumerate(request.tokens)]
        assert [e.logprob for e in entries] == pytest.approx(want, abs=1e-4)
        assert all(len(e.top) == 2 and e.top[0] == (e.token, pytest.approx(e.logprob)) for e in entries)
        scored = [expected[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
        assert request.prompt_logprobs[0] is None
        assert [e.logprob for e in request.prompt_logprobs[1:]] == pytest.approx(scored, abs=1e-4)


def test_a_prompt_only_scored_holds_no_slot():
    """max_tokens = 0: the prompt's log-probabilities and the end, also while every slot is taken."""
    model = _model("tiny-efla")
    scheduler = _scheduler(model, max_batch=1, max_context=100_000)
    try:
        busy = Collector(1)
        running = scheduler.submit([[5, 6, 7]], SamplingParams(max_tokens=50_000), busy)
        scored = Collector(1)
        request = scheduler.submit([[9, 10, 11, 12]], SamplingParams(max_tokens=0, prompt_logprobs=0), scored)[0]
        scored.wait()
        final = scored.final(request)
        assert isinstance(final, FinishEvent) and (final.reason, final.completion_tokens) == ("length", 0)
        assert len(request.prompt_logprobs) == 4 and all(len(e.top) == 0 for e in request.prompt_logprobs[1:])
        assert not running[0].done  # it ran beside the slot's holder
        scheduler.cancel(running)
        busy.wait()
    finally:
        scheduler.close()
