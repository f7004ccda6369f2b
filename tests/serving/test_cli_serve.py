"""`efla serve`: user mistakes are one line with exit status 2; on SIGTERM the server finishes the
request in flight, refuses new ones, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from efla.cli import main

from .conftest import MODEL_NAME, REPO, error_of, http_stack, serve

http_stack()
import httpx  # noqa: E402

GOOD_BODY = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    "options, option",
    [
        (["--port", "70000"], "--port"),
        (["--max-batch", "0"], "--max-batch"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--api-key", " "], "--api-key"),
        (["--max-body-bytes", "10"], "--max-body-bytes"),
        (["--read-timeout", "0"], "--read-timeout"),
        (["--write-timeout", "-1"], "--write-timeout"),
        (["--max-connections", "0"], "--max-connections"),
        (["--speculate", "eagle"], "--speculate"),
        (["--speculate", "draft_model"], "--draft-model"),
        (["--draft-model", "nowhere"], "--draft-model"),
        (["--speculate", "draft_model", "--draft-model", "nowhere"], "--draft-model"),
        (["--speculate", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens"),
        (["--prompt-lookup-max", "2"], "--prompt-lookup-max"),
    ],
)
def test_a_wrong_option_is_one_line_with_status_2(model_dir, capsys, options, option):
    assert main(["serve", str(model_dir), *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("efla serve: ") and f"({option}" in err


@pytest.mark.parametrize(
    "content, complaint", [(None, "cannot read the chat template"), ("{% for m in messages %}", "is not valid Jinja")]
)
def test_a_chat_template_that_cannot_be_used_is_one_line_naming_the_file(model_dir, tmp_path, capsys, content, complaint):
    template = tmp_path / "chat.jinja"
    if content is not None:
        template.write_text(content, encoding="utf-8")
    assert main(["serve", str(model_dir), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and complaint in err and str(template) in err and "(--chat-template)" in err


def test_a_missing_model_directory_is_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(MODEL_DIR)" in err


def test_a_port_in_use_is_reported_before_loading(model_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", str(model_dir), "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("efla serve: cannot listen on 127.0.0.1:") and err.count("\n") == 1


def test_a_server_shutting_down_answers_503(loaded):
    with serve(*loaded) as served:
        served.scheduler.stop_accepting()  # what SIGTERM does first
        response = httpx.post(f"{served.url}/v1/completions", json=GOOD_BODY, timeout=10)
    assert response.status_code == 503 and error_of(response)["code"] == "shutting_down"


@contextmanager
def _started(model_dir, *options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`efla serve` in a process of its own and its URL; the process is killed if a test leaves it running."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "efla",
            "serve",
            str(model_dir),
            "--port",
            "0",
            "--log-level",
            "warning",
            "--max-context",
            "4096",
            "--served-model-name",
            MODEL_NAME,
            *options,
        ],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = next((line.split(" at ")[1].split("/v1")[0] for line in process.stderr if " at http://" in line), None)
        assert url is not None, f"the server did not start (status {process.wait(10)})"
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_sigterm_finishes_the_request_in_flight_and_exits_0(model_dir, reference):
    want_text, _, want_reason = reference(GOOD_BODY["prompt"], 300)
    with _started(model_dir) as (process, url):
        body = {**GOOD_BODY, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = json.loads(next(lines)[len("data: ") :])
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [first] + [json.loads(line[len("data: ") :]) for line in rest[:-1]]
        # the whole completion, as generate makes it alone, not cut short by the shutdown
        assert "".join(c["choices"][0]["text"] for c in chunks) == want_text
        assert chunks[-1]["choices"][0]["finish_reason"] == want_reason
        assert process.wait(60) == 0
        err = process.stderr.read()
        assert "Traceback" not in err, err


def test_sigterm_past_the_grace_period_ends_streams_with_length_and_exits_0(model_dir):
    with _started(model_dir, "--shutdown-timeout", "1") as (process, url):
        body = {**GOOD_BODY, "max_tokens": 4000, "ignore_eos": True, "stream": True}  # longer than the grace
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = json.loads(next(lines)[len("data: ") :])
            process.send_signal(signal.SIGTERM)
            refused = httpx.post(f"{url}/v1/completions", json=GOOD_BODY, timeout=10)  # the listener is still open
            rest = [line for line in lines if line]
        assert refused.status_code == 503 and error_of(refused)["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert rest[-1] == "data: [DONE]"
        chunks = [first] + [json.loads(line[len("data: ") :]) for line in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["finish_reason"] is not None) == 1
        assert process.wait(60) == 0
        err = process.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err


def test_chat_completions_use_the_template_file_given(model_dir, tmp_path, reference):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    with _started(model_dir, "--chat-template", str(template)) as (process, url):
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "def "}, {"role": "user", "content": "main("}]
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
        assert answer.choices[0].message.content == reference("def main(", 6)[0]  # rendered as the contents joined
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_speculate_with_a_draft_model_directory_serves_the_plain_greedy_text(model_dir, reference):
    """`efla serve --speculate draft_model --draft-model DIR` (the model's own directory: a second
    copy, so every draft is kept): the greedy text is generate's, and /health counts the drafts."""
    want_text, _, want_reason = reference(GOOD_BODY["prompt"], 40)
    with _started(model_dir, "--speculate", "draft_model", "--draft-model", str(model_dir)) as (process, url):
        answer = httpx.post(f"{url}/v1/completions", json={**GOOD_BODY, "max_tokens": 40}, timeout=60).json()
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (want_text, want_reason)
        counts = httpx.get(f"{url}/health", timeout=10).json()["speculation"]
        assert counts["method"] == "draft_model" and counts["accepted"] == counts["drafted"] > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def test_a_draft_model_with_another_tokenizer_is_one_line(model_dir, tmp_path, capsys):
    from efla.data.tokenizer import train_bpe_tokenizer

    from .conftest import _save_model

    other = tmp_path / "other-draft"
    _save_model(other, "tiny-efla", train_bpe_tokenizer(["a different text, another vocabulary " * 50], vocab_size=300))
    argv = ["serve", str(model_dir), "--port", "0", "--speculate", "draft_model", "--draft-model", str(other)]
    capsys.readouterr()  # the saving's progress bars
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its tokenizer differs from the model's (--draft-model)" in err
