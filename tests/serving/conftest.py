"""Fixtures of the serving tests: a tiny model directory with a BPE tokenizer, a second copy of the model
for reference continuations (``efla.generation.generate``, one request at a time), and servers run by
uvicorn in a thread on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import pathlib
import socket
import threading
import time

import pytest
import torch


def http_stack() -> None:
    """Skip (the module, or the test calling it) unless the serve extra and the HTTP test clients are
    installed (the scheduler's own tests need neither)."""
    for name in ("fastapi", "uvicorn", "prometheus_client", "jinja2", "openai", "httpx"):
        pytest.importorskip(name)


REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"


def _save_model(path: pathlib.Path, preset: str, tokenizer) -> None:
    from efla.models import EFLAForCausalLM, get_preset_config

    cfg = get_preset_config(preset)
    cfg.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    EFLAForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="package")
def tokenizer_source():
    from efla.data.tokenizer import train_bpe_tokenizer

    text = "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "efla").rglob("*.py")))[:20_000]
    return train_bpe_tokenizer([text], vocab_size=320)


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory, tokenizer_source) -> pathlib.Path:
    """A tiny-efla model with random weights and a byte-level BPE trained on this repository's sources."""
    path = tmp_path_factory.mktemp("serving") / "tiny"
    _save_model(path, "tiny-efla", tokenizer_source)
    return path


@pytest.fixture(scope="package")
def hybrid_dir(tmp_path_factory, tokenizer_source) -> pathlib.Path:
    path = tmp_path_factory.mktemp("serving") / "tiny-hybrid"
    _save_model(path, "tiny-hybrid-efla", tokenizer_source)
    return path


def load(path):
    import efla  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="package")
def loaded(model_dir):
    """The model the servers run."""
    return load(model_dir)


@pytest.fixture(scope="package")
def reference_model(model_dir):
    """Another copy of the same model, for ``generate`` while a server runs the first."""
    return load(model_dir)


class Reference:
    """What ``efla.generation.generate`` makes of one prompt alone: text, token count, finish reason."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def tokens(self, prompt_ids: list[int], max_tokens: int, **sampling) -> list[int]:
        from efla.generation import generate

        eos = self.tokenizer.eos_token_id
        out = generate(self.model, torch.tensor([prompt_ids]), max_new_tokens=max_tokens, eos_token_id=eos, **sampling)
        new = out[0, len(prompt_ids) :].tolist()
        return new[: new.index(eos) + 1] if eos in new else new

    def __call__(self, prompt: str, max_tokens: int, **sampling) -> tuple[str, int, str]:
        ids = self.tokenizer(prompt)["input_ids"]
        new = self.tokens(ids, max_tokens, **sampling)
        reason = "stop" if new and new[-1] == self.tokenizer.eos_token_id else "length"
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new), reason


@pytest.fixture(scope="package")
def reference(reference_model):
    return Reference(*reference_model)


class Served:
    """A running server: its base URL, scheduler and uvicorn server (``DrainingServer``)."""

    def __init__(self, url: str, scheduler, server):
        self.url, self.scheduler, self.server = url, scheduler, server

    def client(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """/health once every slot is free again and nothing waits (or the last report at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            idle = status["slots_free"] == status["slots_total"] and status["waiting"] == 0 and status["decoding"] == 0
            if idle or time.monotonic() > deadline:
                return status
            time.sleep(0.01)


@contextlib.contextmanager
def serve(
    model,
    tokenizer,
    *,
    api_key: str | None = None,
    prefix_cache=None,
    chat_template: str | None = None,
    limits=None,
    app_options: dict | None = None,
    grace: float = 5.0,
    send_buffer: int | None = None,
    **options,
):
    """A server for ``model`` on a free port of 127.0.0.1, uvicorn in a thread as ``efla serve`` runs
    it; stopped on exit. ``limits``: its ``ConnectionLimits``; ``app_options``: ``create_app``'s limits;
    ``grace``: the drain after ``server.handle_exit``; ``send_buffer``: the sockets' kernel send buffer
    in bytes (small: a client that does not read fills it soon)."""
    from efla.serving import Scheduler, create_app
    from efla.serving.server import ConnectionLimits, DrainingServer, server_config

    options = {"max_batch": 16, "max_queue": 64, "max_context": 512, **options}
    scheduler = Scheduler(
        model,
        tokenizer,
        prefix_cache=prefix_cache,
        stop_tokens=[tokenizer.eos_token_id],
        pad_token=tokenizer.pad_token_id,
        **options,
    )
    app = create_app(
        scheduler, tokenizer, model_name=MODEL_NAME, api_key=api_key, chat_template=chat_template, **(app_options or {})
    )
    sock = socket.socket()
    if send_buffer is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    config = server_config(app, limits or ConnectionLimits(), log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, scheduler, grace)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.005)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", scheduler, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not scheduler.running, "the scheduler's thread outlived the server"


@pytest.fixture(scope="package")
def server(loaded):
    """A shared server: 16 slots, no prefix cache, prompts prefilled 32 tokens per step."""
    with serve(*loaded, prefill_chunk=32) as served:
        yield served


def error_of(response) -> dict:
    """The ``error`` object of an OpenAI-shaped error response (its four fields checked)."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]
