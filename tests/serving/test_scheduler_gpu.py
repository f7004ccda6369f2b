"""The scheduler on a GPU (captured decoding steps and prefills, pinned copies, one-step-late reads):
concurrent greedy requests in float32 give generate's tokens one request at a time, with prompts
prefilled in chunks of one or several rows, slots reused and a prefix cache on; every slot is free
again afterwards. Captured prefills of padded rows give the eager engine's states and logits."""

from __future__ import annotations

import pytest
import torch

from efla.serving import PrefixCache, SamplingParams, Scheduler

from .test_scheduler import EOS, Collector

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_heads=2, head_dim=128)


def _model(preset: str):
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config(preset, **SMALL)).cuda().eval()


def _alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    from efla.generation import generate

    out = generate(model, torch.tensor([prompt], device="cuda"), max_new_tokens=max_tokens, eos_token_id=EOS)
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(EOS) + 1] if EOS in new else new


@pytest.mark.parametrize(("preset", "prefill_chunk"), [("tiny-efla", 32), ("tiny-efla", 256), ("tiny-gated-deltanet", 256)])
def test_concurrent_greedy_requests_give_generates_tokens(preset, prefill_chunk):
    model = _model(preset)
    generator = torch.Generator().manual_seed(2)
    system = torch.randint(3, 512, (40,), generator=generator).tolist()
    prompts = [
        (system if i % 3 == 0 else []) + torch.randint(3, 512, (n,), generator=generator).tolist()
        for i, n in enumerate((5, 90, 33, 12, 64, 7, 150, 21, 48, 3, 77, 16))
    ]
    lengths = [8 + 5 * i for i in range(len(prompts))]
    expected = [_alone(model, p, n) for p, n in zip(prompts, lengths)]
    scheduler = Scheduler(
        model,
        None,
        stop_tokens=[EOS],
        max_batch=8,
        max_context=512,
        prefill_chunk=prefill_chunk,
        prefix_cache=PrefixCache(block=16),
    )
    scheduler.start()
    try:
        collector = Collector(len(prompts))
        requests = [scheduler.submit([p], SamplingParams(max_tokens=n), collector)[0] for p, n in zip(prompts, lengths)]
        collector.wait()
        assert [r.tokens for r in requests] == expected
        status = scheduler.status()
        assert status["slots_free"] == 8 and status["peak_batch"] == 8
        assert status["prefix_cache"]["hits"] >= 1
    finally:
        scheduler.close()


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla"])
def test_captured_prefill_rows_equal_the_eager_ones(preset):
    from efla.generation.engine import DecodeEngine

    from ..generation.test_prefill_rows import LENGTHS, ROUNDS, SLOTS, _states

    model = _model(preset)
    captured, eager = DecodeEngine(model, use_cuda_graph=True), DecodeEngine(model, use_cuda_graph=False)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]
    for engine in (captured, eager):
        engine.reserve(4)
        for state in engine.cache.states:
            for tensor in (state["recurrent_state"], *state["conv_state"]):
                tensor.normal_(generator=torch.Generator(device="cuda").manual_seed(5))
    for pieces in ROUNDS:
        args = ([prompts[i][a:b] for i, a, b in pieces], [SLOTS[i] for i, _, _ in pieces], [a == 0 for _, a, _ in pieces])
        torch.testing.assert_close(captured.prefill_rows(*args), eager.prefill_rows(*args), rtol=1e-4, atol=1e-4)
    assert captured.prefill_buckets and all(b.graph is not None for b in captured.prefill_buckets.values())
    for slot in SLOTS:
        for got, want in zip(_states(captured.cache, slot), _states(eager.cache, slot), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1).cpu()


def test_forked_choices_and_log_probabilities_from_captured_steps():
    """n = 3 greedy choices of each prompt (one prefill, the state copied) give generate's tokens; the
    log-probabilities of the captured steps and of the prompt are the model's forward's."""
    model = _model("tiny-efla")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (37, 70)]
    scheduler = Scheduler(model, None, stop_tokens=[EOS], max_batch=8, max_context=512, prefix_cache=PrefixCache(block=16))
    scheduler.start()
    try:
        collector = Collector(6)
        params = SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1)
        requests = scheduler.submit(prompts, params, collector, 3)
        collector.wait()
        assert scheduler.status()["prompt_tokens_prefilled"] == sum(map(len, prompts))
    finally:
        scheduler.close()
    for i, request in enumerate(requests):
        prompt = prompts[i // 3]
        assert request.tokens == _alone(model, prompt, 12)
        expected = _log_softmax(model, prompt + request.tokens)
        entries = [entry for r, event in collector.events if r is request for entry in event.logprobs]
        assert [e.token for e in entries] == request.tokens
        want = [expected[len(prompt) - 1 + j, t].item() for j, t in enumerate(request.tokens)]
        assert [e.logprob for e in entries] == pytest.approx(want, abs=1e-3)
        assert all(len(e.top) == 2 and e.top[0] == (e.token, pytest.approx(e.logprob)) for e in entries)
        scored = [expected[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
        assert request.prompt_logprobs[0] is None
        assert [e.logprob for e in request.prompt_logprobs[1:]] == pytest.approx(scored, abs=1e-3)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_requests_give_the_plain_schedulers_greedy_tokens(method):
    """Speculative rounds on the GPU (eager passes, rollback by copies) beside captured plain steps
    (rounds without drafts), with the prefix cache on: the plain scheduler's tokens."""
    import copy

    model = _model("tiny-efla")
    generator = torch.Generator().manual_seed(3)
    system = torch.randint(3, 512, (40,), generator=generator).tolist()
    prompts = [
        (system if i % 2 else []) + torch.randint(3, 512, (n,), generator=generator).tolist()
        for i, n in enumerate((5, 30, 12, 1, 60, 9))
    ]
    draft = copy.deepcopy(model)
    speculate = {"method": "ngram", "prompt_lookup_min": 1} if method == "ngram" else {"method": "draft_model", "model": draft}
    speculate["verify_cost"] = 1  # every round with a draft verifies
    outputs, counts = [], None
    for options in ({}, {"speculate": speculate}):
        scheduler = Scheduler(
            model, None, stop_tokens=[EOS], max_batch=4, max_context=512, prefix_cache=PrefixCache(block=16), **options
        )
        scheduler.start()
        try:
            collector = Collector(len(prompts))
            requests = [scheduler.submit([p], SamplingParams(max_tokens=48), collector)[0] for p in prompts]
            collector.wait()
            outputs.append([r.tokens for r in requests])
            counts = scheduler.status()["speculation"]
        finally:
            scheduler.close(30)
    assert outputs[1] == outputs[0]
    assert counts["accepted"] > 0
