"""Logit processors through the openai client: logit_bias, presence, frequency and repetition
penalties, min_tokens and ignore_eos give the tokens of a plain reference loop (the model's forward
over the whole sequence, the processors applied as documented, greedy); a processed request leaves
the others in its batch unchanged."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .conftest import MODEL_NAME, http_stack

http_stack()

PROMPT = "for layer in self.layers:\n    hidden = layer(hidden)\n    hidden = layer("
MAX_TOKENS = 12


def processed_greedy(model, prompt: list[int], eos: int, *, logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0, min_tokens=0, ignore_eos=False) -> list[int]:  # fmt: skip
    """Greedy tokens with the processors applied in efla.serving.processors' order. (The tiny model's
    greedy answer repeats no token: negative penalties, which favour repeats, change it.)"""
    new: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + new])).logits[0, -1].float()
        for token, bias in (logit_bias or {}).items():
            logits[int(token)] += bias
        for token in set(prompt) | set(new):
            logits[token] = logits[token] / repetition_penalty if logits[token] > 0 else logits[token] * repetition_penalty
        for token, count in Counter(new).items():
            logits[token] -= frequency_penalty * count + presence_penalty
        if len(new) < min_tokens:
            logits[eos] = float("-inf")
        new.append(int(logits.argmax()))
        if new[-1] == eos and not ignore_eos:
            break
    return new


def _completion(client, **processors):
    extra = {k: processors.pop(k) for k in ("repetition_penalty", "min_tokens", "ignore_eos") if k in processors}
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, extra_body=extra, **processors
    )
    return response.choices[0], response.usage.completion_tokens


def _check(server, reference_model, processors: dict) -> list[int]:
    model, tokenizer = reference_model
    prompt = tokenizer(PROMPT)["input_ids"]
    want = processed_greedy(model, prompt, tokenizer.eos_token_id, **processors)
    choice, completion_tokens = _completion(server.client(), **dict(processors))
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want]
    assert choice.text == tokenizer.decode(want, skip_special_tokens=True) and completion_tokens == len(want)
    return want


@pytest.mark.parametrize(
    "processors",
    [
        {"presence_penalty": -2.0},
        {"presence_penalty": -1.0, "frequency_penalty": 0.6},
        {"repetition_penalty": 0.5},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    ],
    ids=["presence", "frequency", "repetition", "all three"],
)
def test_penalties_give_the_reference_loops_tokens(server, reference_model, processors):
    model, tokenizer = reference_model
    plain = processed_greedy(model, tokenizer(PROMPT)["input_ids"], tokenizer.eos_token_id)
    assert _check(server, reference_model, processors) != plain  # the penalty changes the answer


def test_logit_bias_steers_and_bans_tokens(server, reference_model):
    model, tokenizer = reference_model
    plain = processed_greedy(model, tokenizer(PROMPT)["input_ids"], tokenizer.eos_token_id)
    banned = _check(server, reference_model, {"logit_bias": {str(t): -100 for t in set(plain[:3])}})
    assert not set(plain[:3]) & set(banned)
    steered = _check(server, reference_model, {"logit_bias": {str(plain[5]): 6.0}})
    assert steered != plain


def test_min_tokens_and_ignore_eos_hold_the_end_of_sequence_back(server, reference_model):
    eos = reference_model[1].eos_token_id
    to_eos = {"logit_bias": {str(eos): 100}}  # the end of sequence at once, unless held back
    assert _check(server, reference_model, to_eos) == [eos]
    held = _check(server, reference_model, {**to_eos, "min_tokens": 4})
    assert len(held) == 5 and held[-1] == eos and eos not in held[:4]
    choice, completion_tokens = _completion(server.client(), **to_eos, ignore_eos=True)
    assert choice.finish_reason == "length" and completion_tokens == MAX_TOKENS and choice.text == ""


def test_a_processed_request_leaves_its_neighbours_unchanged(server, reference, reference_model):
    client = server.client()
    prompts = ["import torch", "def main(", "The model", "class EFLA"]

    def plain(prompt):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        neighbours = [pool.submit(plain, p) for p in prompts]
        processed = pool.submit(_completion, client, frequency_penalty=1.5, repetition_penalty=1.5)
        texts = [n.result() for n in neighbours]
        choice, _ = processed.result()
    assert texts == [reference(p, MAX_TOKENS)[0] for p in prompts]
    model, tokenizer = reference_model
    want = processed_greedy(
        model, tokenizer(PROMPT)["input_ids"], tokenizer.eos_token_id, frequency_penalty=1.5, repetition_penalty=1.5
    )
    assert choice.text == tokenizer.decode(want, skip_special_tokens=True)


def test_chat_takes_the_processors_too(loaded, reference_model):
    from .conftest import serve
    from .test_chat import MESSAGES, TEMPLATE

    eos = reference_model[1].eos_token_id
    with serve(*loaded, chat_template=TEMPLATE) as served:
        response = served.client().chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"min_tokens": 2},
        )
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "stop"
