"""``efla generate``: text continuations of prompts from a saved efla model directory, streamed as they
are generated, or as one JSON line per prompt (``--json``; all prompts in one left-padded batch).
Argument checks and printing only; the decoding is :func:`efla.generation.generate`."""

from __future__ import annotations

import argparse
import json
import sys

from efla.commands.saved_model import add_model_options, check_model_dir, checked_device_and_dtype, load_model, stop_tokens_of
from efla.commands.speculation_options import add_speculation_options, check_speculation, speculation
from efla.errors import UsageError

_EPILOG = """\
examples:
  efla generate runs/lm/efla-s0 "The meaning of life is" --max-new-tokens 40
  efla generate runs/lm/efla-s0 --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 0 --json
  efla generate runs/lm/efla-s0 "def main(" --speculate ngram --num-speculative-tokens 4
  efla generate runs/lm/efla-s0 "The model" --speculate draft_model --draft-model runs/lm/tiny-efla
Temperature 0 (the default) is greedy decoding; --top-k, --top-p and --seed need sampling (temperature > 0).
A PROMPT that starts with '-' goes after `--`.
"""


def _read_prompts_file(path: str) -> list[str]:
    """One prompt per line (blank lines skipped); a byte that is not UTF-8 is named with its line."""
    from efla import arg_checks as check

    check.existing_file(path, "--prompts-file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise UsageError(f"{path}: cannot be read ({error.strerror or error}) (--prompts-file)") from None
    prompts = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(
                f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}) (--prompts-file)"
            ) from None
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte order mark
        line = line.removesuffix("\r")
        if line.strip():
            prompts.append(line)
    return prompts


def _check_options(args) -> None:
    from efla import arg_checks as check

    check.at_least(args.max_new_tokens, 1, "--max-new-tokens")
    check.at_least(args.temperature, 0, "--temperature")
    check.at_least(args.top_k, 0, "--top-k")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"expected a value in (0, 1], got {args.top_p:g} (--top-p)")
    check.at_least(args.seed, 0, "--seed")
    if args.temperature == 0:
        check.not_ignored(
            args,
            {"top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"},
            "with greedy decoding, the default temperature 0; sampling needs --temperature above 0",
        )
    check_speculation(args)


# -- loading and generating ------------------------------------------------------------------------


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _until_stop(ids: list[int], stop_tokens: list[int]) -> tuple[list[int], str]:
    """A row's new tokens up to and including its first stop token, and the finish reason."""
    for j, t in enumerate(ids):
        if t in stop_tokens:
            return ids[: j + 1], "stop"
    return ids, "length"


class _PrintStreamer:
    """Prints a single row's continuation as it comes (a transformers-style streamer: ``put`` / ``end``).
    The first ``put`` (the prompt) is skipped; tokens after a stop token (the padding of a finished
    row) are ignored. Each print is the new part of the decoding of all tokens so far, so the
    printed text is exactly the decoding of the whole continuation; an incomplete UTF-8 character
    at the end waits for its next token."""

    def __init__(self, tokenizer, stop_tokens: list[int], out=None):
        self.tokenizer, self.stop_tokens = tokenizer, set(stop_tokens)
        self.out = out
        self.ids: list[int] = []
        self.printed = ""
        self.prompt_pending = True
        self.stopped = False

    def put(self, value) -> None:
        if self.prompt_pending:
            self.prompt_pending = False
            return
        for t in value.reshape(-1).tolist():
            if self.stopped:
                break
            self.ids.append(int(t))
            self.stopped = int(t) in self.stop_tokens
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)
        self._write("\n")

    def _emit(self, final: bool) -> None:
        text = _decode(self.tokenizer, self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self._write(text[len(self.printed) :])
            self.printed = text

    def _write(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()


def _encode(tokenizer, prompts: list[str]) -> list[list[int]]:
    encoded = []
    for prompt in prompts:
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:
            raise UsageError(f"the prompt {prompt!r} encodes to no tokens (PROMPT)")
        encoded.append(ids)
    return encoded


def _sampling(args, positions: range, speculate=None) -> dict:
    """``generate``'s sampling settings for the prompts at ``positions``: prompt ``i`` samples with
    seed ``--seed + i``, so no two prompts share a sample and a prompt's text does not depend on
    the prompts beside it (streamed one by one or in one ``--json`` batch)."""
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=None if args.top_p in (None, 1.0) else args.top_p,
        seed=None if args.seed is None else [args.seed + i for i in positions],
        speculate=speculate,
    )


def _stream(model, tokenizer, prompts, encoded, stop_tokens, pad_id, args, speculate) -> None:
    import torch

    from efla.generation import generate

    device = next(model.parameters()).device
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        if i:
            print(flush=True)
        print(prompt, end="", flush=True)
        streamer = _PrintStreamer(tokenizer, stop_tokens)
        generate(
            model,
            torch.tensor([ids], device=device),
            eos_token_id=stop_tokens,
            pad_token_id=pad_id,
            streamer=streamer,
            **_sampling(args, range(i, i + 1), speculate),
        )


def _json_lines(model, tokenizer, prompts, encoded, stop_tokens, pad_id, args, speculate) -> None:
    import torch

    from efla.generation import generate

    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    width = max(map(len, encoded))
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    out = generate(
        model,
        input_ids.to(device),
        attention_mask=mask.to(device),
        eos_token_id=stop_tokens,
        pad_token_id=pad_id,
        **_sampling(args, range(len(encoded)), speculate),
    )
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        new, reason = _until_stop(row, stop_tokens)
        line = {"prompt": prompt, "text": _decode(tokenizer, new), "new_tokens": len(new), "finish_reason": reason}
        print(json.dumps(line, ensure_ascii=False), flush=True)


def cmd_generate(args) -> int:
    check_model_dir(args.model_dir)
    _check_options(args)
    device, dtype = checked_device_and_dtype(args)
    prompts = list(args.prompts or [])
    if args.prompts_file is not None:
        prompts += _read_prompts_file(args.prompts_file)
    if not prompts:
        if args.prompts_file is not None:
            raise UsageError(f"no prompt given: {args.prompts_file} has no prompt lines (--prompts-file)")
        raise UsageError("no prompt given (PROMPT or --prompts-file)")

    model, tokenizer = load_model(args.model_dir, device, dtype)
    speculate = speculation(args, model, tokenizer, device, dtype)
    encoded = _encode(tokenizer, prompts)
    stop_tokens = stop_tokens_of(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = stop_tokens[0] if stop_tokens else 0
    if args.json:
        _json_lines(model, tokenizer, prompts, encoded, stop_tokens, pad_id, args, speculate)
    else:
        _stream(model, tokenizer, prompts, encoded, stop_tokens, pad_id, args, speculate)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="continue prompts with a saved efla model (streamed, or JSON lines with --json)",
        description="Load a model directory written by `efla train` (or save_pretrained plus a tokenizer) and "
        "continue each prompt: streamed to stdout prompt by prompt, or with --json all prompts in one "
        "left-padded batch and one JSON object per prompt per line (prompt, text, new_tokens, "
        "finish_reason).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts (each continued on its own)")
    p.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="UTF-8 text file, one prompt per line (blank lines skipped); after the PROMPTs",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt at most (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0: greedy (default); above 0: sampling from softmax(logits / T)",
    )
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens (0: off)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the smallest set of tokens with probability >= P, 0 < P <= 1 (1: off)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="sampling seed: prompt i samples with seed S + i (same seed, same output)",
    )
    add_speculation_options(p)
    p.add_argument(
        "--json", action="store_true", help="one JSON object per prompt per line: prompt, text, new_tokens, finish_reason"
    )
    p.set_defaults(func=cmd_generate)
    _accept_prompts_after_options(p)


def _accept_prompts_after_options(parser) -> None:
    """``efla generate MODEL --json "a prompt"``: PROMPTs may follow options (argparse alone gives the
    positionals only their first run of arguments)."""
    parser.intermixed = True
