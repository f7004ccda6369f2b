"""``response_format`` (``json_object``, ``json_schema``) on /v1/completions and /v1/chat/completions:
the tiny random model's outputs follow each schema because the grammar forces them, greedy and sampled,
alone and as forks (``n``); a request without one in the same batch keeps generate's tokens; wrong
formats are 400s naming ``response_format``."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import MODEL_NAME, error_of, http_stack, serve

http_stack()
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
import httpx  # noqa: E402

# bounded strings and integers: a random model closes a free string or number only by chance
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
                "required": ["id", "tag"],
            },
        }
    },
    "required": ["items"],
}
NESTED = {
    "type": "object",
    "properties": {
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
        },
        "label": {"enum": ["x", "y"]},
    },
    "required": ["owner", "label"],
}
SCHEMAS = {"person": PERSON, "color": COLOR, "items": ITEMS, "nested": NESTED}
MAX_TOKENS = 200  # far more than any of these schemas' values take
PROMPT = "def forward(self, x):"
TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


def schema_format(schema: dict, strict: bool | None = None) -> dict:
    spec = {"name": "answer", "schema": schema, **({} if strict is None else {"strict": strict})}
    return {"type": "json_schema", "json_schema": spec}


def assert_follows(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def chat_server(loaded):
    with serve(*loaded, chat_template=TEMPLATE, prefill_chunk=32) as served:
        yield served


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_and_sampled_completions_follow_the_schema(server, name):
    client, schema = server.client(), SCHEMAS[name]
    greedy = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": schema_format(schema)},
    )
    choices = list(greedy.choices)
    for seed in (0, 7):
        sampled = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=1,
            seed=seed,
            n=3,
            extra_body={"response_format": schema_format(schema, strict=True)},
        )
        choices += sampled.choices
    for c in choices:
        assert c.finish_reason == "stop", c.text
        assert_follows(c.text, schema)
    assert len({c.text for c in choices}) > 1  # sampling still chooses among what the grammar allows


@pytest.mark.parametrize("name", SCHEMAS)
def test_chat_answers_follow_the_schema(chat_server, name):
    client, schema = chat_server.client(), SCHEMAS[name]
    for temperature, seed in ((0, None), (1, 1), (1, 2), (1, 3)):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=seed,
            response_format=schema_format(schema),
        )
        c = response.choices[0]
        assert c.finish_reason == "stop", c.message.content
        assert_follows(c.message.content, schema)
        assert response.usage.completion_tokens <= MAX_TOKENS


def test_a_streamed_answer_joins_to_a_valid_value(chat_server):
    stream = chat_server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1, seed=5, stream=True,
        response_format=schema_format(PERSON),
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_follows("".join(ch.choices[0].delta.content or "" for ch in chunks), PERSON)


def test_json_object_gives_an_object(server):
    response = server.client().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1,
        seed=0,
        n=4,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for c in response.choices:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":  # a random model's free object may outlast max_tokens
            assert isinstance(json.loads(c.text), dict)


def test_a_request_without_a_format_keeps_its_tokens_beside_structured_ones(server, reference):
    client = server.client()

    def structured(seed):
        return client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1, seed=seed, n=2,
            extra_body={"response_format": schema_format(ITEMS)},
        )  # fmt: skip

    def plain():
        return client.completions.create(model=MODEL_NAME, prompt="import torch", max_tokens=24, temperature=0)

    alone = plain().choices[0].text
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(structured, seed) for seed in range(4)]
        beside = [pool.submit(plain) for _ in range(2)]
        for future in others:
            for c in future.result().choices:
                assert_follows(c.text, ITEMS)
        texts = [future.result().choices[0].text for future in beside]
    expected, _, _ = reference("import torch", 24)
    assert texts == [alone, alone] and alone == expected


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "xml"}, "'xml'"),
        ({"type": "json_schema"}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "schema"),
        (schema_format({"type": "nonsense"}), "not valid"),
        (schema_format({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "not valid"),
        ("json", "dictionary"),
    ],
)
def test_a_wrong_response_format_is_a_400(server, chat_server, response_format, words):
    for url, route, body in (
        (server.url, "completions", {"prompt": PROMPT}),
        (chat_server.url, "chat/completions", {"messages": MESSAGES}),
    ):
        response = httpx.post(
            f"{url}/v1/{route}", json={"model": MODEL_NAME, "response_format": response_format, **body}, timeout=30
        )
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert error["param"] == "response_format" and words in error["message"], error


def test_a_format_with_ignore_eos_is_a_400(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "response_format": {"type": "json_object"}, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and error_of(response)["param"] == "response_format"


def test_without_xgrammar_a_format_is_a_400_naming_it(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "response_format" and "xgrammar" in error["message"]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "response_format": {"type": "text"}}, timeout=30)
    assert plain.status_code == 200  # the rest is still served
