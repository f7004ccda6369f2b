"""n and best_of: one prefill per prompt, its recurrent state copied into the other choices' slots;
greedy choices are copies of the n = 1 answer, with or without the prefix cache; choice j of a
seeded request samples as a request of seed + j alone; best_of returns the choices of the highest
total log-probability; a hybrid model (no state copies) gives the same answers."""

from __future__ import annotations

import pytest

from efla.serving import PrefixCache

from .conftest import MODEL_NAME, error_of, http_stack, load, serve

http_stack()
import httpx  # noqa: E402

PROMPT = "class EFLA(nn.Module):\n    def __init__(self, config):\n        super().__init__()\n        self.layers ="


@pytest.fixture(scope="module")
def forking_server(loaded):
    with serve(*loaded, max_batch=8, prefill_chunk=16) as served:
        yield served


def _texts(response) -> list[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def test_n_greedy_choices_copy_one_prefill(forking_server, reference):
    client = forking_server.client()
    prompt_tokens = len(reference.tokenizer(PROMPT)["input_ids"])
    before = forking_server.health()["prompt_tokens_prefilled"]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, n=3)
    assert forking_server.health()["prompt_tokens_prefilled"] - before == prompt_tokens  # prefilled once
    assert _texts(response) == [reference(PROMPT, 12)[0]] * 3
    assert response.usage.prompt_tokens == prompt_tokens


def test_n_choices_of_several_prompts_are_numbered_prompt_by_prompt(forking_server, reference):
    prompts = ["import torch", "def main("]
    response = forking_server.client().completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert _texts(response) == [reference(p, 6)[0] for p in prompts for _ in range(2)]


def test_choice_j_of_a_seeded_request_samples_as_seed_plus_j_alone(forking_server):
    client = forking_server.client()

    def sampled(seed: int, n: int) -> list[str]:
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, n=n)
        return _texts(response)

    three = sampled(11, 3)
    assert three == [sampled(11 + j, 1)[0] for j in range(3)]
    assert len(set(three)) > 1


def test_streamed_choices_join_to_the_plain_ones(forking_server):
    client = forking_server.client()
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=2, n=2)
    pieces = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=2, n=2, stream=True
    ):
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert [pieces[0], pieces[1]] == _texts(plain)


def test_best_of_returns_the_choices_of_the_highest_log_probability(forking_server):
    client = forking_server.client()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 4}
    all_four = client.completions.create(**body, n=4, logprobs=0).choices
    ranked = sorted(all_four, key=lambda c: -sum(c.logprobs.token_logprobs))
    best_two = client.completions.create(**body, n=2, best_of=4)
    assert _texts(best_two) == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in best_two.choices)  # not asked for
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, best_of=3)
    assert len(greedy.choices) == 1


def test_forked_choices_from_a_cached_prefix_change_no_token(loaded, reference):
    system = "# The recurrent state is a fixed-size matrix per head, updated once per token.\n" * 3
    prompts = [system + "def step(", system + "def prefill(", system + "def step("]  # the last one: from the cache
    with serve(*loaded, max_batch=8, prefill_chunk=16, prefix_cache=PrefixCache(block=16)) as served:
        client = served.client()
        for prompt in prompts:
            response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, n=3)
            assert _texts(response) == [reference(prompt, 10)[0]] * 3
        assert served.health()["prefix_cache"]["hits"] >= 1


def test_a_hybrid_model_gives_the_same_choices_without_copying_states(hybrid_dir):
    model, tokenizer = load(hybrid_dir)
    with serve(model, tokenizer, max_batch=4) as served:
        client = served.client()
        one = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
        three = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert _texts(three) == [one.choices[0].text] * 3


@pytest.mark.parametrize("choices, param", [({"n": 9}, "n"), ({"best_of": 9}, "best_of")])
def test_more_choices_than_slots_is_a_400_naming_the_field(forking_server, choices, param):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **choices}
    response = httpx.post(f"{forking_server.url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 400 and error_of(response)["param"] == param
