"""/v1/completions through the real openai client: concurrent greedy requests give exactly
efla.generation.generate's continuations, streams join to the plain text, stop strings cut where they
should, seeded sampling repeats whatever runs beside it, and usage counts tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


from .conftest import MODEL_NAME, http_stack, serve

http_stack()
import httpx  # noqa: E402

PROMPTS = [
    "def main(",
    "import torch",
    "The model",
    "class EFLA",
    "return self",
    "for i in range(",
    "x = torch.",
    "if __name__",
    "    def forward(",
    "from efla",
    "raise ValueError(",
    "# the state",
    "with torch.no_grad():",
    "cache = ",
    "print(",
    "assert ",
]


def test_sixteen_concurrent_greedy_requests_match_generate_one_at_a_time(server, reference):
    client = server.client()

    def complete(prompt):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(complete, PROMPTS))
    for prompt, response in zip(PROMPTS, responses):
        text, n_tokens, reason = reference(prompt, 12)
        assert response.choices[0].text == text, prompt
        assert response.choices[0].finish_reason == reason
        prompt_tokens = len(reference.tokenizer(prompt)["input_ids"])
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, n_tokens)
        assert response.usage.total_tokens == prompt_tokens + n_tokens
        assert response.model == MODEL_NAME and response.object == "text_completion"


def test_a_list_of_prompts_decodes_as_one_batch(loaded, reference):
    with serve(*loaded, max_batch=8) as served:
        response = served.client().completions.create(model=MODEL_NAME, prompt=PROMPTS[:8], max_tokens=10, temperature=0)
        assert served.health()["peak_batch"] == 8  # submitted together: all eight decode in the same steps
    assert [c.index for c in response.choices] == list(range(8))
    for prompt, c in zip(PROMPTS, response.choices):
        assert c.text == reference(prompt, 10)[0]
    assert response.usage.completion_tokens == sum(reference(p, 10)[1] for p in PROMPTS[:8])


def test_streamed_chunks_join_to_the_plain_text(server):
    client = server.client()
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1  # streamed piece by piece, not in one chunk
    assert "".join(texts) == plain.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_a_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL_NAME, "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 2


def test_stop_strings_cut_the_text_before_them(server, reference):
    client = server.client()
    full, _, _ = reference(PROMPTS[0], 24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True
        )
    ]
    assert "".join(streamed) == expected
    assert not any(stop in piece for piece in streamed)


def test_seeded_sampling_repeats_whatever_runs_beside_it(server, reference):
    client = server.client()
    sampling = {"temperature": 0.9, "top_p": 0.95}

    def seeded():
        return (
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, seed=7, extra_body={"top_k": 50}, **sampling
            )
            .choices[0]
            .text
        )

    alone = seeded()
    with ThreadPoolExecutor(8) as pool:
        neighbours = [
            pool.submit(client.completions.create, model=MODEL_NAME, prompt=p, max_tokens=16, **sampling) for p in PROMPTS[4:11]
        ]
        together = pool.submit(seeded).result()
        [n.result() for n in neighbours]
    assert together == alone
    # the request's noise is drawn from its own generator as generate draws it for a batch of one
    assert alone == reference(PROMPTS[3], 16, temperature=0.9, top_k=50, top_p=0.95, seed=7)[0]
    other_seed = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, seed=8, extra_body={"top_k": 50}, **sampling
        )
        .choices[0]
        .text
    )
    assert other_seed != alone  # 16 tokens drawn from ~300: another seed differs


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL_NAME
    assert health["slots_total"] == 16 and health["prefix_cache"] == {"enabled": False, "reason": "off"}


def test_stop_token_ids_end_the_text_before_them(server, reference):
    tokenizer = reference.tokenizer
    new = reference.tokens(tokenizer(PROMPTS[5])["input_ids"], 12)
    first = new.index(new[3])  # where that token first comes
    body = {"model": MODEL_NAME, "prompt": PROMPTS[5], "max_tokens": 12, "temperature": 0}
    response = server.client().completions.create(**body, extra_body={"stop_token_ids": [new[3]]})
    assert response.choices[0].text == tokenizer.decode(new[:first], skip_special_tokens=True)
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == first + 1
    streamed = server.client().completions.create(**body, extra_body={"stop_token_ids": [new[3]]}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == response.choices[0].text
    wrong = httpx.post(f"{server.url}/v1/completions", json={**body, "stop_token_ids": [10**6]}, timeout=10)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "stop_token_ids"
