"""``efla serve``: an OpenAI-compatible HTTP server for a saved efla model directory, with continuous
batching over the decoding engine's state slots (``efla.serving``). Argument checks, loading and
running uvicorn; the serving itself is :mod:`efla.serving`."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from efla.commands.saved_model import add_model_options
from efla.commands.speculation_options import add_speculation_options, check_speculation, speculation
from efla import environment
from efla.errors import UsageError

_EPILOG = """\
examples:
  efla serve runs/lm/efla-s0
  efla serve runs/lm/efla-s0 --host 0.0.0.0 --port 8080 --max-batch 256 --api-key "$KEY"
  efla serve runs/lm/efla-s0 --chat-template chat.jinja   # a tokenizer without a chat template
  efla serve runs/lm/efla-s0 --speculate ngram             # speculative decoding by prompt lookup
  efla serve runs/lm/efla-s0 --speculate draft_model --draft-model runs/lm/tiny-efla
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "efla-s0", "prompt": "The meaning of life is", "max_tokens": 32, "temperature": 0}'
Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI's; top_k as an extension), GET
/v1/models, POST /tokenize and /detokenize (vLLM's), GET /metrics (Prometheus), GET /health (slots,
queue, prefix-cache hit rate; the only route open without the --api-key). SIGTERM or SIGINT: new
requests get 503 while those in flight finish (up to --shutdown-timeout seconds, then each ends
with finish_reason "length"), exit 0. The server writes no files.
"""


def _check_libraries() -> None:
    import importlib.util

    needed = ("fastapi", "uvicorn", "prometheus_client", "jinja2")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"efla serve needs {' and '.join(missing)}: pip install 'efla[serve]' (fastapi, uvicorn, prometheus-client, jinja2)"
        )


def _check_options(args) -> None:
    from efla import arg_checks as check

    if not 0 <= args.port <= 65535:
        raise UsageError(f"expected a port in 0..65535 (0: any free port), got {args.port} (--port)")
    check.at_least(args.max_batch, 1, "--max-batch")
    check.at_least(args.max_queue, 0, "--max-queue")
    check.at_least(args.max_context, 2, "--max-context")
    check.at_least(args.prefill_chunk, 1, "--prefill-chunk")
    check.at_least(args.prefill_every, 1, "--prefill-every")
    check.at_least(args.prefix_cache_mb, 0, "--prefix-cache-mb")
    check.at_least(args.prefix_block, 1, "--prefix-block")
    check.at_least(args.shutdown_timeout, 0, "--shutdown-timeout")
    check.at_least(args.max_body_bytes, 1024, "--max-body-bytes")
    check.positive(args.read_timeout, "--read-timeout")
    check.positive(args.write_timeout, "--write-timeout")
    check.at_least(args.max_connections, 1, "--max-connections")
    check.at_least(args.seed, 0, "--seed")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("the API key is empty (--api-key or EFLA_API_KEY)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("the model name is empty (--served-model-name)")
    check_speculation(args)


def _refuse_ignored_options(args) -> None:
    from efla import arg_checks as check

    if args.prefix_cache_mb == 0:
        check.not_ignored(args, {"prefix_block": "--prefix-block"}, "while --prefix-cache-mb 0 turns the prefix cache off")


def _read_chat_template(path: str | None) -> str | None:
    """The chat template in ``path`` (``None``: use the tokenizer's), read before the model loads."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            template = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise UsageError(f"cannot read the chat template {path}: {reason} (--chat-template)") from None
    if not template.strip():
        raise UsageError(f"the chat template {path} is empty (--chat-template)")
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(template)
    except TemplateSyntaxError as error:
        raise UsageError(
            f"the chat template {path} is not valid Jinja: line {error.lineno}: {error.message} (--chat-template)"
        ) from None
    return template


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, listening before the model loads: a port in use is reported at once, and a
    client that connects early waits until the server answers."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error} (--host, --port)") from None
    return sock


def _check_tokenizer(tokenizer, path: str) -> None:
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise UsageError(
            f"the tokenizer in {path} has no fast (tokenizers) version, which efla serve decodes streamed text with (MODEL_DIR)"
        )


def _scheduler(model, tokenizer, args, speculate=None):
    from efla.serving import PrefixCache, Scheduler

    from efla.commands.saved_model import stop_tokens_of

    stop_tokens = stop_tokens_of(model, tokenizer)
    cache = PrefixCache(block=args.prefix_block, max_bytes=args.prefix_cache_mb << 20) if args.prefix_cache_mb else None
    max_context = args.max_context or int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return Scheduler(
        model,
        tokenizer,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_context=max_context,
        prefill_chunk=args.prefill_chunk,
        prefill_every=args.prefill_every,
        prefix_cache=cache,
        stop_tokens=stop_tokens,
        pad_token=tokenizer.pad_token_id,
        seed=args.seed,
        speculate=speculate,
    )


def _serve(app, sock: socket.socket, scheduler, args) -> None:
    from efla.serving.server import ConnectionLimits, DrainingServer, server_config

    limits = ConnectionLimits(args.read_timeout, args.write_timeout, args.max_connections)
    config = server_config(app, limits, log_level=args.log_level)
    DrainingServer(config, scheduler, grace=args.shutdown_timeout).run(sockets=[sock])


def cmd_serve(args) -> int:
    from efla.commands.saved_model import check_model_dir, checked_device_and_dtype, load_model

    _check_libraries()
    check_model_dir(args.model_dir)
    _check_options(args)
    _refuse_ignored_options(args)
    chat_template = _read_chat_template(args.chat_template)
    device, dtype = checked_device_and_dtype(args)
    sock = _listen(args.host, args.port)
    try:
        model, tokenizer = load_model(args.model_dir, device, dtype)
        _check_tokenizer(tokenizer, args.model_dir)
        speculate = speculation(args, model, tokenizer, device, dtype)
        scheduler = _scheduler(model, tokenizer, args, speculate)
        scheduler.start()
        from efla.serving import create_app

        name = args.served_model_name or os.path.basename(os.path.abspath(args.model_dir))
        app = create_app(
            scheduler,
            tokenizer,
            model_name=name,
            api_key=args.api_key,
            chat_template=chat_template,
            max_body_bytes=args.max_body_bytes,
            read_timeout=args.read_timeout,
        )
        host, port = sock.getsockname()[:2]
        cache = f"prefix cache {args.prefix_cache_mb} MB" if scheduler.prefix_cache is not None else "no prefix cache"
        speculating = f", speculative decoding: {args.speculate}" if args.speculate else ""
        print(
            f"efla serve: {name} at http://{host}:{port}/v1 ({device}, {args.max_batch} slots, "
            f"{args.max_queue} queue places, context {scheduler.max_context}, {cache}{speculating})",
            file=sys.stderr,
            flush=True,
        )
        _serve(app, sock, scheduler, args)
    finally:
        sock.close()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a saved efla model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Load a model directory (config, safetensors weights, tokenizer) and serve OpenAI's completions and chat "
        "API: requests share the model step by step in a pool of --max-batch state slots (continuous "
        "batching), prompts are prefilled in chunks between decoding steps, and states after recent "
        "prompt prefixes are reused. Needs pip install 'efla[serve]'.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0: any free port)")
    p.add_argument(
        "--max-batch", type=int, default=64, metavar="N", help="state slots: requests decoding at once (default: %(default)s)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests that may wait for a slot; more get HTTP 429 (default: %(default)s)",
    )
    p.add_argument(
        "--served-model-name", default=None, metavar="NAME", help="the model name of the API (default: MODEL_DIR's name)"
    )
    p.add_argument(
        "--api-key",
        default=environment.get("EFLA_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $EFLA_API_KEY, else no key)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's own, if it has one)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens of a request, prompt and completion (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="the most prompt tokens prefilled between two decoding steps (default: 2048 on a GPU, 512 on the CPU)",
    )
    p.add_argument(
        "--prefill-every",
        type=int,
        default=None,
        metavar="N",
        help="while half the slots or more decode, prefill once every N decoding steps (default: 1)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=1024,
        metavar="MB",
        help="memory for states after recent prompt prefixes, on the model's device (0: off; hybrid "
        "models with attention layers go without; default: %(default)s)",
    )
    p.add_argument(
        "--prefix-block",
        type=int,
        default=64,
        metavar="N",
        help="prefixes are cached at multiples of N tokens (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM or SIGINT, seconds for requests in flight to finish (new ones get 503) before each "
        "ends with finish_reason 'length' (default: %(default)s)",
    )
    limits = p.add_argument_group("limits on clients")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        metavar="N",
        help="the largest request body; larger ones get 413 (default: %(default)s, 8 MiB)",
    )
    limits.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a connection whose request headers have not arrived S seconds after it opened is closed, "
        "and a body that has not arrived S seconds after them gets 408 (default: %(default)s)",
    )
    limits.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a client that reads nothing of its response for S seconds while it waits to be sent is "
        "dropped and its requests end (default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="open connections beyond N get 503 (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=None, metavar="S", help="seeds the sampling of requests without a seed of their own"
    )
    add_speculation_options(p.add_argument_group("speculative decoding (each decoding step one speculative round)"))
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: %(default)s)",
    )
    p.set_defaults(func=cmd_serve)
