"""/v1/completions as lm-eval and other clients use it, through the real openai client: token-id
prompts, echo, and log-probabilities equal to the model's own log-softmax (a transformers forward of
the whole sequence, float32 on the CPU) within 1e-4."""

from __future__ import annotations

import pytest
import torch

from .conftest import MODEL_NAME, http_stack, load, serve

http_stack()
import httpx  # noqa: E402

PROMPT = "def forward(self, hidden_states, cache=None):\n    return"
TOLERANCE = 1e-4


def log_softmax_of(reference_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: the log-distribution after each prefix, by the model's own forward."""
    model, _ = reference_model
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_token_id_prompts_give_the_text_of_their_strings(server, reference):
    client = server.client()
    ids = [reference.tokenizer(p)["input_ids"] for p in (PROMPT, "import torch")]
    by_text = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "import torch"], max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10, temperature=0)
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=10, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert one.choices[0].text == by_text.choices[0].text == reference(PROMPT, 10)[0]
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_echo_with_max_tokens_0_scores_the_prompt(server, reference_model):
    tokenizer = reference_model[1]
    ids = tokenizer(PROMPT)["input_ids"]
    response = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=5, temperature=0
    )
    c = response.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = log_softmax_of(reference_model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=TOLERANCE)
        top_values, top_ids = expected[i - 1].topk(5)
        top, expected_top = lp.top_logprobs[i], {}
        for token, value in zip(top_ids.tolist(), top_values.tolist()):  # two tokens may decode alike
            expected_top.setdefault(tokenizer.decode([token]), value)
        for token_text, value in expected_top.items():
            assert top[token_text] == pytest.approx(value, abs=TOLERANCE)
        assert len(top) <= 6  # the five most likely, and the prompt's token if it is not among them


def test_lm_eval_style_scoring_of_a_list_of_token_id_prompts(server, reference_model):
    """echo, logprobs = 1, max_tokens = 1: every prompt token's log-probability, then one new token's."""
    tokenizer = reference_model[1]
    prompts = [tokenizer(p)["input_ids"] for p in ("import torch\nx = torch.zeros(", "class EFLA(nn.Module):")]
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0},
        timeout=30,
    ).json()
    for ids, c in zip(prompts, response["choices"]):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        expected = log_softmax_of(reference_model, ids)
        new_token = int(expected[-1].argmax())  # greedy
        assert c["text"] == tokenizer.decode(ids + [new_token], skip_special_tokens=True)
        scored = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))] + [expected[-1, new_token].item()]
        assert lp["token_logprobs"][1:] == pytest.approx(scored, abs=TOLERANCE)
        # lm-eval's is_greedy: the new token is the most likely one
        assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1], abs=TOLERANCE)


def _new_token_logprobs(server, stream: bool, **sampling):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "logprobs": 3, **sampling}
    if not stream:
        c = server.client().completions.create(**body).choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset
    tokens, values, offsets, text = [], [], [], ""
    for chunk in server.client().completions.create(**body, stream=True):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    return text, tokens, values, offsets


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.7, "top_k": 20, "seed": 3}], ids=["greedy", "hot"])
def test_new_tokens_log_probabilities_are_the_models_before_temperature(server, reference, reference_model, stream, sampling):
    tokenizer = reference_model[1]
    top_k = sampling.get("top_k", 0)
    openai_sampling = {k: v for k, v in sampling.items() if k != "top_k"} | {"extra_body": {"top_k": top_k}}
    text, tokens, values, offsets = _new_token_logprobs(server, stream, **openai_sampling)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    new_ids = reference.tokens(prompt_ids, 12, **sampling)  # the same tokens, as the seeded tests show
    assert text == tokenizer.decode(new_ids, skip_special_tokens=True)
    assert tokens == [tokenizer.decode([t]) for t in new_ids]
    expected = log_softmax_of(reference_model, prompt_ids + new_ids)[len(prompt_ids) - 1 :]
    assert values == pytest.approx([expected[i, t].item() for i, t in enumerate(new_ids)], abs=TOLERANCE)
    assert offsets == [len(PROMPT) + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    if sampling["temperature"] > 0:  # drawn at 1.7 from the top 20: some token is not the most likely
        assert any(values[i] < expected[i].max().item() - 1e-3 for i in range(len(new_ids)))


def test_a_streamed_echo_opens_with_the_prompt_and_joins_to_the_plain_answer(server):
    client = server.client()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2}
    plain = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == plain.text and plain.text.startswith(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)] == getattr(plain.logprobs, key)
    echoed_only = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "x = 1"], max_tokens=0, echo=True)
    assert [c.text for c in echoed_only.choices] == [PROMPT, "x = 1"]
    assert all(c.logprobs is None for c in echoed_only.choices)


def test_a_hybrid_models_prompt_log_probabilities(hybrid_dir):
    model, tokenizer = load(hybrid_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    with serve(model, tokenizer, max_batch=2) as served:
        c = served.client().completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0).choices[0]
    expected = log_softmax_of((model, tokenizer), ids)
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [expected[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOLERANCE
    )
    assert all(len(top) == 1 for top in c.logprobs.top_logprobs[1:])  # logprobs = 0: the prompt's token only
