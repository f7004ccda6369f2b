"""vLLM's /tokenize and /detokenize, /v1/models/{model}, and /metrics in Prometheus' text format
(counters and gauges that follow the requests served, a registry per app)."""

from __future__ import annotations

import pytest

from .conftest import MODEL_NAME, error_of, http_stack, serve

http_stack()
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def test_tokenize_and_detokenize_round_trip(server, reference):
    tokenizer = reference.tokenizer
    response = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": "def main():"}, timeout=10).json()
    ids = tokenizer("def main():")["input_ids"]
    assert response == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL_NAME, "tokens": ids}, timeout=10).json()
    assert back == {"prompt": "def main():"}


def test_tokenize_renders_messages_with_the_chat_template(loaded):
    tokenizer = loaded[1]
    messages = [{"role": "user", "content": "hi"}]
    with serve(*loaded, chat_template=TEMPLATE) as served:
        response = httpx.post(f"{served.url}/tokenize", json={"messages": messages}, timeout=10).json()
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert response["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert response["tokens"][0] == tokenizer.bos_token_id  # the template's own special token, not an added one


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenizer_route_mistakes_are_400s_naming_the_field(server, route, body, param):
    response = httpx.post(f"{server.url}{route}", json=body, timeout=10)
    assert response.status_code == 400 and error_of(response)["param"] == param


def test_a_model_by_name(server):
    model = server.client().models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.owned_by == "efla"
    response = httpx.get(f"{server.url}/v1/models/other", timeout=10)
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def _metrics(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples}


def _observations(metrics: dict[str, float], histogram: str) -> float:
    """How many values a latency histogram took in (its count, not a duration)."""
    return metrics[f"{histogram}_seconds_count"]


def test_metrics_follow_the_requests_served(loaded, reference):
    from efla.serving import PrefixCache

    prompt = "# a shared prefix of a few blocks of tokens, long enough to be cached\n" * 2 + "def main("
    with serve(*loaded, max_batch=4, prefix_cache=PrefixCache(block=8)) as served, serve(*loaded) as other:
        before = _metrics(served.url)
        assert before["efla_slots_total"] == 4 and before["efla_requests_running"] == 0
        assert before["efla_requests_waiting"] == 0 and before["efla_prompt_tokens_total"] == 0
        client = served.client()
        responses = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0) for _ in range(2)]
        after = _metrics(served.url)
        prompt_tokens = len(reference.tokenizer(prompt)["input_ids"])
        assert after["efla_prompt_tokens_total"] == 2 * prompt_tokens
        assert after["efla_generation_tokens_total"] == sum(r.usage.completion_tokens for r in responses)
        assert after["efla_prefix_cache_queries_total"] == 2 and after["efla_prefix_cache_hits_total"] == 1
        assert _observations(after, "efla_time_to_first_token") == 2
        assert _observations(after, "efla_time_per_output_token") == sum(r.usage.completion_tokens > 1 for r in responses)
        assert after["efla_slots_in_use"] == 0
        assert _metrics(other.url)["efla_prompt_tokens_total"] == 0  # each app counts its own
