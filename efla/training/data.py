"""The training data of ``efla train``: the text files checked, the tokenizer trained (byte-level
BPE) or loaded, the token streams of ``--data`` / ``--val-data`` (tokenized once into a cache) and
the train/validation split; a user's mistake is a ``UsageError`` naming the files and the option."""

from __future__ import annotations

import os
import warnings

from efla.data.text import NoTextError, check_text_files, load_token_stream, read_documents, split_train_val
from efla.data.tokenizer import get_tokenizer, load_tokenizer
from efla.errors import RunWarning, UsageError

from efla.training.config import Sizes, TrainConfig
from efla.training.process_group import Dist

__all__ = ["check_text", "prepare_tokenizer", "load_data"]


def prepare_tokenizer(cfg: TrainConfig, dist: Dist, resuming: bool, log):

    have = os.path.exists(os.path.join(cfg.out, "tokenizer_config.json"))
    if not (resuming and have) and dist.main:
        log(_tokenizer_phase(cfg))

        def texts():
            budget = cfg.tokenizer_train_chars
            for doc in read_documents(cfg.data, cfg.text_field, cfg.gutenberg_strip, cfg.accept_invalid_utf8):
                if budget <= 0:
                    return
                yield doc[:budget]
                budget -= len(doc)

        get_tokenizer(cfg.tokenizer, texts_factory=texts, vocab_size=cfg.vocab_size, save_dir=cfg.out)
    dist.barrier()
    return load_tokenizer(cfg.out)


def _tokenizer_phase(cfg: TrainConfig) -> str:
    if cfg.tokenizer not in (None, "", "bpe"):
        return f"loading the tokenizer {cfg.tokenizer} (--tokenizer)"
    return (
        f"training the tokenizer: byte-level BPE of {cfg.vocab_size:,} tokens on up to "
        f"{cfg.tokenizer_train_chars:,} characters (--vocab-size, --tokenizer-train-chars)"
    )


def load_data(cfg: TrainConfig, r: Sizes, tok, eos_id: int, dist: Dist, log):

    cache = cfg.cache_dir or os.path.join(cfg.out, "cache")
    # rank 0 tokenizes (and fills the cache) first; the others then read the cache
    toks = val_toks = None
    for turn in ((True,), (False,)):
        if dist.main == turn[0]:
            toks = _token_stream(cfg, cfg.data, "--data", tok, eos_id, cache, log)
            if cfg.val_data:
                val_toks = _token_stream(cfg, cfg.val_data, "--val-data", tok, eos_id, cache, log)
        dist.barrier()
    _check_fills_a_sequence(toks, r.seq_len, cfg.data, "--data")
    if val_toks is not None:
        _check_fills_a_sequence(val_toks, r.seq_len, cfg.val_data, "--val-data")
    elif cfg.val_sequences >= len(toks) // r.seq_len:
        raise UsageError(
            f"{_files_named(cfg.data)}: --val-sequences {cfg.val_sequences} would leave no training data "
            f"({len(toks) // r.seq_len} sequences of {r.seq_len} tokens in all) "
            "(--val-sequences, or more --data)"
        )
    return split_train_val(toks, r.seq_len, cfg.val_sequences, val_seed=1234, val_tokens=val_toks)


def _check_fills_a_sequence(tokens, seq_len: int, paths: list, option: str) -> None:
    if len(tokens) < seq_len:
        raise UsageError(
            f"{_files_named(paths)}: {len(tokens)} tokens do not fill one sequence of {seq_len} tokens "
            f"(--seq-len, or more {option})"
        )


def _files_named(paths: list, shown: int = 3) -> str:
    return ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def _token_stream(cfg: TrainConfig, paths: list, option: str, tok, eos_id: int, cache: str, log):

    def log_naming_the_files(message: str) -> None:
        log(f"{message} ({option} {_files_named(paths)})")

    try:
        return load_token_stream(
            paths, tok, eos_id, cache, cfg.text_field, cfg.gutenberg_strip, cfg.accept_invalid_utf8, log=log_naming_the_files
        )
    except NoTextError:
        raise UsageError(f"{_files_named(paths)}: no text to train on, every document is empty ({option})") from None


def check_text(cfg: TrainConfig, dist: Dist, log) -> None:

    def warn(message: str) -> None:
        if dist.main:
            warnings.warn(message, RunWarning, stacklevel=2)

    log("checking the text files (--data" + (", --val-data)" if cfg.val_data else ")"))
    for paths, option in ((cfg.data, "--data"), (cfg.val_data or [], "--val-data")):
        checks = check_text_files(paths, cfg.accept_invalid_utf8, warn, option=option)
        if checks and not any(p.startswith("hf:") for p in paths) and not any(c.has_text for c in checks):
            raise UsageError(f"{_files_named([c.path for c in checks])}: empty, no text to train on ({option})")
