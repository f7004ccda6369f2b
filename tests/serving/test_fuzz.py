"""Requests generated from the server's own OpenAPI schema (schemathesis), valid ones and broken ones,
against a tiny model on the CPU: no answer is a 5xx, every answer has a status, content type and
body the schema documents, and afterwards every slot is free, nothing waits, and a greedy request
gives the tokens it gave before.

``--serve-fuzz-examples N`` sets the examples per route and mode (default: a CI-size run of a few
hundred requests in all; thousands per route for a nightly run)."""

from __future__ import annotations

import pytest

from .conftest import MODEL_NAME, http_stack, serve

http_stack()
pytest.importorskip("schemathesis")
import httpx  # noqa: E402

GENERATING = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GREEDY = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 12, "temperature": 0}


def _fuzz(url: str, examples: int) -> tuple[dict[str, int], list[str]]:
    """Requests to every route of ``url``'s schema, up to ``examples`` per route and mode; the number
    sent per route and the failures (each a route, a check's message and the request's body)."""
    import schemathesis

    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", timeout=10).json())
    sent, failures = {}, []
    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode in schemathesis.GenerationMode:
            count, found = _fuzz_operation(url, operation, mode, examples)
            sent[operation.label] = sent.get(operation.label, 0) + count
            failures += found
    return sent, failures


def _fuzz_operation(url: str, operation, mode, examples: int) -> tuple[int, list[str]]:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    sent, failures = [], []

    @settings(
        max_examples=examples,
        derandomize=True,  # the same requests every run
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # every failure is reported, none shrunk
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case):
        sent.append(case)
        try:
            case.call_and_validate(base_url=url, checks=checks, timeout=60)
        except Exception as failure:  # every failure is collected, the run goes on  # noqa: BLE001
            failures.append(f"{operation.label} ({mode.value}): {failure}\n  body: {case.body!r}"[:2000])

    from hypothesis.errors import Unsatisfiable

    try:
        send()
    except Unsatisfiable:  # a route without parameters has no broken requests
        assert mode.value == "negative", operation.label
    return len(sent), failures


def test_generated_requests_get_no_5xx_conform_to_the_schema_and_leave_the_pool_whole(loaded, request):
    examples = request.config.getoption("--serve-fuzz-examples")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with serve(*loaded, max_batch=4, max_queue=8, max_context=48, chat_template=template) as served:
        client = httpx.Client(timeout=60)
        before = client.post(f"{served.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        sent, failures = _fuzz(served.url, examples)
        total = sum(sent.values())
        assert not failures, f"{len(failures)} of {total} requests failed:\n" + "\n".join(failures[:10])
        status = served.wait_idle()
        assert (status["slots_free"], status["waiting"], status["decoding"]) == (4, 0, 0), status
        assert served.scheduler.running
        after = client.post(f"{served.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    assert len(sent) == 8 and all(sent[f"POST {route}"] >= examples for route in GENERATING), sent
    assert after == before
