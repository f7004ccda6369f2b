"""/v1/chat/completions through the real openai client: messages rendered by the chat template the
server was given, greedy answers equal to generate's continuation of the rendered prompt, streaming
(the role first, content pieces, the finish reason, usage), n, logprobs, stop, token limits, seeds;
a model without a template is a 400 saying how to give one."""

from __future__ import annotations

import pytest
import torch

from .conftest import MODEL_NAME, error_of, http_stack, serve

http_stack()
import httpx  # noqa: E402
import openai  # noqa: E402

TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def forward(self, x):"},
]


@pytest.fixture(scope="module")
def chat_server(loaded):
    with serve(*loaded, chat_template=TEMPLATE, prefill_chunk=32) as served:
        yield served


def rendered_ids(tokenizer, messages=MESSAGES) -> list[int]:
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_greedy_answer_is_generates_continuation_of_the_rendered_prompt(chat_server, reference):
    response = chat_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    ids = rendered_ids(reference.tokenizer)
    new = reference.tokens(ids, 12)
    c = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.message.content == reference.tokenizer.decode(new, skip_special_tokens=True)
    assert c.finish_reason == ("stop" if new[-1] == reference.tokenizer.eos_token_id else "length")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), len(new))


def test_text_parts_render_as_their_joined_text(chat_server):
    client = chat_server.client()
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "def forward("}, {"type": "text", "text": "self, x):"}]},
    ]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    by_parts = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=8, temperature=0)
    assert by_parts.choices[0].message.content == plain.choices[0].message.content


def test_a_stream_opens_with_the_role_and_joins_to_the_plain_answer(chat_server):
    client = chat_server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    with_choices = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert content == plain.choices[0].message.content
    assert len([c for c in with_choices if c.choices[0].delta.content]) > 1
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[-1] == plain.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    no_usage = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_n_greedy_choices_are_copies_and_sampled_ones_follow_their_seeds(chat_server):
    client = chat_server.client()
    one = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    three = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    def sampled(n):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5, n=n
        )
        return [c.message.content for c in response.choices]

    assert sampled(2) == sampled(2)
    assert sampled(2)[0] == sampled(1)[0]
    assert len(set(sampled(3))) > 1  # each choice draws its own tokens


def test_logprobs_are_the_models_log_softmax(chat_server, reference, reference_model):
    model, tokenizer = reference_model
    response = chat_server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    ids = rendered_ids(tokenizer)
    new = reference.tokens(ids, 8)
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in new]
    with torch.no_grad():
        expected = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 :].float().log_softmax(-1)
    for i, entry in enumerate(content[: len(new)]):
        assert entry.logprob == pytest.approx(expected[i].max().item(), abs=1e-4)  # greedy: the most likely token
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[1].logprob == pytest.approx(expected[i].topk(2).values[1].item(), abs=1e-4)
    plain = chat_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_and_token_limits(chat_server):
    client = chat_server.client()
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0).choices[0]
    text = full.message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0, stop=stop)
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    limited = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=24, max_completion_tokens=3, temperature=0
    )
    assert limited.usage.completion_tokens == 3 and limited.choices[0].finish_reason == "length"
    unlimited = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)
    assert unlimited.choices[0].finish_reason in ("stop", "length")  # no limit: up to the context


def test_a_model_without_a_template_is_a_400_saying_how_to_give_one(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    body = caught.value.body
    assert body["param"] == "messages" and "--chat-template FILE" in body["message"]


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"tools": []}, "tools"),
    ],
)
def test_an_invalid_chat_field_is_a_400_naming_it(chat_server, change, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **change}
    response = httpx.post(f"{chat_server.url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and error["message"].startswith(f"{param}:")


def test_an_unknown_route_is_an_openai_error_naming_it(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"}, timeout=10)
    assert response.status_code == 404
    assert "POST /v1/embeddings" in error_of(response)["message"]


def test_streamed_choices_carry_their_log_probabilities(chat_server):
    client = chat_server.client()
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.9, "seed": 1, "n": 2}
    plain = client.chat.completions.create(**body, logprobs=True, top_logprobs=1)
    content, entries, roles = {0: "", 1: ""}, {0: [], 1: []}, []
    for chunk in client.chat.completions.create(**body, logprobs=True, top_logprobs=1, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            content[c.index] += c.delta.content or ""
            entries[c.index] += c.logprobs.content if c.logprobs else []
    assert sorted(roles) == [0, 1]
    for c in plain.choices:
        assert content[c.index] == c.message.content
        assert [(e.token, e.logprob) for e in entries[c.index]] == [(e.token, e.logprob) for e in c.logprobs.content]
