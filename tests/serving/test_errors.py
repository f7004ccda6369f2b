"""Errors in OpenAI's shape with the right status (400 naming the field, 401, 404, 429), and no request,
however wrong or abandoned, crashes the server or keeps a slot."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import MODEL_NAME, error_of, http_stack, serve

http_stack()
import httpx  # noqa: E402
import openai  # noqa: E402

GOOD = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"1000000": 1}}, "logit_bias"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"suffix": "x"}, "suffix"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"frequency": 1}, "frequency"),
        ({"model": None}, "model"),
    ],
)
def test_an_invalid_field_is_a_400_naming_it(server, change, param):
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, **change}, timeout=10)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}:")


def test_a_prompt_beyond_the_context_is_a_400(server):
    long_prompt = "def main(): return 1\n" * 200  # well over the 512 tokens the test server allows
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": long_prompt}, timeout=10)
    assert response.status_code == 400
    assert error_of(response)["param"] == "prompt" and error_of(response)["code"] == "context_length_exceeded"
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "max_tokens": 510}, timeout=10)
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"


def test_a_body_that_is_not_json_is_a_400(server):
    response = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == 400 and error_of(response)["param"] is None


def test_an_unknown_model_is_a_404_through_the_client(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    response = httpx.get(f"{server.url}/v2/nothing", timeout=10)
    assert response.status_code == 404 and error_of(response)["code"] == "404"


def test_the_api_key_is_required_on_v1(loaded):
    with serve(*loaded, api_key="sesame") as served:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = httpx.post(f"{served.url}/v1/completions", json=GOOD, headers=headers, timeout=10)
            assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
            assert httpx.get(f"{served.url}/v1/models", headers=headers, timeout=10).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            served.client(api_key="wrong").models.list()
        assert served.client(api_key="sesame").completions.create(**GOOD).choices[0].text is not None
        assert served.health()["status"] == "ok"  # probes need no key


def _stream_open(url: str, max_tokens: int = 100_000):
    """A streamed request held open (its response headers read: it is submitted)."""
    client = httpx.Client(timeout=30)
    body = {**GOOD, "max_tokens": max_tokens, "stream": True}
    response = client.send(client.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    return client, response


def test_a_full_queue_is_a_429_and_closed_streams_free_their_slots(loaded):
    with serve(*loaded, max_batch=1, max_queue=1, max_context=200_000) as served:
        running = _stream_open(served.url)
        waiting = _stream_open(served.url)
        with pytest.raises(openai.RateLimitError) as caught:
            served.client().completions.create(**GOOD)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
        next(running[1].iter_lines())  # the running one streams
        for client, response in (running, waiting):
            response.close()
            client.close()
        status = served.wait_idle()
        assert status["slots_free"] == 1 and status["waiting"] == 0
        assert served.client().completions.create(**GOOD).choices[0].finish_reason == "length"


def test_a_client_gone_mid_request_frees_its_slot(loaded):
    with serve(*loaded, max_batch=2, max_context=200_000) as served:
        client, response = _stream_open(served.url)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        response.close()
        client.close()
        assert served.wait_idle()["slots_free"] == 2
        with pytest.raises(httpx.ReadTimeout):  # a plain (unstreamed) request whose client gives up
            httpx.post(f"{served.url}/v1/completions", json={**GOOD, "max_tokens": 100_000}, timeout=0.5)
        assert served.wait_idle()["slots_free"] == 2


def _mixed_request(client: httpx.Client, url: str, key: str, kind: str) -> int:
    """One request of a kind; returns its status (checking the error shape of failures); 0: abandoned
    before the answer."""
    auth = {"Authorization": f"Bearer {key}"}
    bodies = {
        "good": GOOD,
        "list": {**GOOD, "prompt": ["import torch", "The model"]},
        "temperature": {**GOOD, "temperature": -3},
        "model": {**GOOD, "model": "other"},
        "long": {**GOOD, "prompt": "x = 1\n" * 400},
        "empty": {**GOOD, "prompt": ""},
    }
    if kind == "no key":
        response = client.post(f"{url}/v1/completions", json=GOOD)
    elif kind == "not json":
        response = client.post(f"{url}/v1/completions", content=b"[1,", headers=auth)
    elif kind == "abandoned stream":  # closed after its first event: the connection goes with it
        request = client.build_request(
            "POST", f"{url}/v1/completions", headers=auth, json={**GOOD, "max_tokens": 400, "stream": True}
        )
        response = client.send(request, stream=True)
        if response.status_code == 200:
            next(response.iter_lines())
        response.close()
        return response.status_code
    elif kind == "abandoned":
        try:
            response = client.post(f"{url}/v1/completions", headers=auth, json={**GOOD, "max_tokens": 400}, timeout=0.05)
        except httpx.TimeoutException:
            return 0
    else:
        response = client.post(f"{url}/v1/completions", headers=auth, json=bodies[kind])
    if response.status_code != 200:
        error_of(response)
    return response.status_code


def test_two_hundred_mixed_requests_leave_the_pool_whole(loaded, reference):
    kinds = ["good", "list", "temperature", "model", "long", "empty", "no key", "not json", "abandoned stream", "abandoned"]
    expected = {
        "good": {200, 429},
        "list": {200, 429},
        "temperature": {400},
        "model": {404},
        "long": {400},
        "empty": {400},
        "no key": {401},
        "not json": {400},
        "abandoned stream": {200, 429},
        "abandoned": {0, 200, 429},
    }
    plan = [kinds[i % len(kinds)] for i in range(200)]
    random.Random(0).shuffle(plan)
    with serve(*loaded, api_key="k", max_batch=4, max_queue=8) as served:
        with ThreadPoolExecutor(16) as pool, httpx.Client(timeout=30) as client:
            statuses = list(pool.map(lambda kind: _mixed_request(client, served.url, "k", kind), plan))
        for kind, status in zip(plan, statuses):
            assert status in expected[kind], (kind, status)
        assert served.scheduler.running
        status = served.wait_idle()
        assert (status["slots_free"], status["waiting"], status["decoding"]) == (4, 0, 0)
        response = served.client(api_key="k").completions.create(
            model=MODEL_NAME, prompt="The model", max_tokens=12, temperature=0
        )
    assert response.choices[0].text == reference("The model", 12)[0]
    assert json.loads(response.model_dump_json())["usage"]["completion_tokens"] == reference("The model", 12)[1]
