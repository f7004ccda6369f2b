"""The settings of an ``efla train`` run (``TrainConfig``, saved as ``train_args.json``) and the
checks made on them before any work starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from efla.data.text import expand_paths
from efla.errors import UsageError
from efla.models import EFLAConfig, get_preset_config
from efla.models.configuration_efla import config_file_keys

from efla import arg_checks as check

__all__ = [
    "SIZE_DEFAULTS",
    "Sizes",
    "TrainConfig",
    "check_train_config",
    "RESUME_FIXED",
    "RESUME_FREE",
    "check_resume_unchanged",
    "stored_train_args",
]

# Per model size: (sequence length, batch size in tokens). 340m/1.3b: the paper's 2K x 512 = 1M tokens.
SIZE_DEFAULTS = {"tiny": (256, 16 * 256), "340m": (2048, 1 << 20), "1.3b": (2048, 1 << 20)}


@dataclass(frozen=True)
class Sizes:
    """A run's sizes resolved from its settings and the number of processes (``train_args.json``'s
    ``resolved``)."""

    seq_len: int  # tokens per sequence
    batch_tokens: int  # tokens per optimizer step, all ranks together
    global_seqs: int  # sequences per step, all ranks together
    per_rank: int  # sequences per step on each rank taking its own data
    micro: int  # sequences per forward
    accum: int  # forwards per step and rank
    max_steps: int
    warmup: int  # warm-up steps of the learning-rate schedule


@dataclass
class TrainConfig:
    """Everything a run depends on (saved as ``train_args.json``); see ``efla train --help``."""

    data: list = field(default_factory=list)
    out: str = "runs/lm/run"
    preset: str | None = "tiny-efla"
    config_file: str | None = None  # an EFLAConfig JSON (instead of a preset)
    val_data: list | None = None  # held-out files; else val_sequences are held out of data
    tokenizer: str | None = None  # HF name/path; None or "bpe": train a byte-level BPE on the data
    vocab_size: int = 4096  # trained tokenizer's vocabulary
    tokenizer_train_chars: int = 50_000_000  # train the tokenizer on at most this many characters
    text_field: str = "text"
    gutenberg_strip: bool = True
    cache_dir: str | None = None  # tokenized data cache (.npy); None: <out>/cache
    seq_len: int | None = None  # None: per-size default (SIZE_DEFAULTS)
    batch_tokens: int | None = None  # global batch in tokens; None: per-size default
    micro_batch_size: int | None = None  # sequences per forward per rank; None: the whole per-rank batch
    varlen: bool = False
    max_steps: int | None = None
    max_tokens: int | None = None  # alternative to max_steps
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int | None = None  # None: max_steps // 8
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0  # model initialisation
    data_seed: int = 0  # data order (same tokens in the same order for every model seed)
    val_sequences: int = 64
    val_every: int = 0  # 0: only at the end
    log_every: int = 1
    save_every: int = 0  # 0: only at the end
    time_limit: float = 0.0  # seconds: stop with a checkpoint at the first step past it (0: no limit)
    keep_checkpoints: int = 3
    resume: bool = False
    resume_from: str | None = None
    resume_or_start: bool = False  # with resume: start a new run when there is no checkpoint
    extend_at_min_lr: bool = False  # resuming with a larger max_steps: keep the schedule, then train at min_lr
    overwrite: bool = False
    accept_invalid_utf8: bool = False  # read bytes that are not UTF-8 as U+FFFD (reported) instead of refusing
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    grad_checkpointing: bool = False
    fsdp: bool = False
    context_parallel: int = 1  # ranks per sequence: each sequence split into this many contiguous parts
    on_nonfinite: str = "stop"  # "stop" or "skip"
    threads: int | None = None
    progress: bool = True


def check_train_config(cfg: TrainConfig) -> None:
    """Every check of ``cfg`` that needs no work (ranges, presets, paths); nothing is written.

    Raises:
        UsageError: naming the option (and the file and line) at fault.
    """
    if not cfg.data:
        raise UsageError("give at least one file or directory (--data)")
    _check_ranges(cfg)
    _check_model_choice(cfg)
    _check_paths(cfg)
    check.device(cfg.device)


def _check_ranges(cfg: TrainConfig) -> None:
    check.at_least(cfg.vocab_size, 259, "--vocab-size")
    check.at_least(cfg.tokenizer_train_chars, 1, "--tokenizer-train-chars")
    check.at_least(cfg.seq_len, 2, "--seq-len")
    check.at_least(cfg.batch_tokens, 2, "--batch-tokens")
    check.at_least(cfg.micro_batch_size, 1, "--micro-batch-size")
    check.at_least(cfg.max_steps, 1, "--max-steps")
    check.at_least(cfg.max_tokens, 1, "--max-tokens")
    check.positive(cfg.lr, "--lr")
    check.at_least(cfg.min_lr, 0, "--min-lr")
    if cfg.min_lr > cfg.lr:
        raise UsageError(f"--min-lr {cfg.min_lr:g} is above the peak --lr {cfg.lr:g} (--min-lr)")
    check.at_least(cfg.warmup_steps, 0, "--warmup-steps")
    check.at_least(cfg.weight_decay, 0, "--weight-decay")
    check.positive(cfg.grad_clip, "--grad-clip")
    check.at_least(cfg.val_sequences, 0, "--val-sequences")
    check.at_least(cfg.val_every, 0, "--val-every")
    check.at_least(cfg.log_every, 1, "--log-every")
    check.at_least(cfg.save_every, 0, "--save-every")
    check.at_least(cfg.time_limit, 0, "--time-limit")
    check.at_least(cfg.keep_checkpoints, 1, "--keep-checkpoints")
    check.at_least(cfg.threads, 1, "--threads")


def _check_model_choice(cfg: TrainConfig) -> None:

    if cfg.config_file:
        check.existing_file(cfg.config_file, "--config")
        fields = _read_config_file(cfg.config_file)
        try:
            model_config = EFLAConfig(**fields)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{cfg.config_file}: not a valid EFLAConfig ({e}) (--config)") from None
    elif not cfg.preset:
        raise UsageError("give a model (--preset or --config)")
    else:
        try:
            model_config = get_preset_config(cfg.preset)
        except ValueError as e:
            raise UsageError(f"{str(e).removeprefix('name: ')} (--preset)") from None
    if (cfg.context_parallel or 1) > 1 and model_config.attn:
        raise UsageError(
            "context parallelism splits only linear-attention layers; this model has softmax-attention "
            f"layers {model_config.attn['layers']} (--context-parallel)"
        )


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}) (--config)") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a UTF-8 text file (--config)") from None
    if not isinstance(fields, dict):
        raise UsageError(f"{path}: expected a JSON object of EFLAConfig fields (--config)")
    check.known_keys(fields, config_file_keys(), path, "--config")
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    return fields


def _check_paths(cfg: TrainConfig) -> None:

    for paths, option in ((cfg.data, "--data"), (cfg.val_data, "--val-data")):
        try:
            expand_paths(paths or [])
        except FileNotFoundError as e:
            raise UsageError(f"{str(e).removeprefix(option + ' ')} ({option})") from None
    if cfg.tokenizer not in (None, "", "bpe") and _looks_local(cfg.tokenizer):
        check.existing_dir(cfg.tokenizer, "--tokenizer")
    check.existing_dir(cfg.resume_from, "--resume-from")
    check.output_dir(cfg.out, "--out")
    if cfg.cache_dir:
        check.output_dir(cfg.cache_dir, "--cache-dir")


def _looks_local(name: str) -> bool:
    return os.path.exists(name) or name.startswith((".", "/", "~")) or os.sep + os.sep in name


# Options a resumed run must keep (they shape the model, the data, its order or the batches): field -> option.
RESUME_FIXED = {
    "preset": "--preset",
    "config_file": "--config",
    "seed": "--seed",
    "data": "--data",
    "val_data": "--val-data",
    "val_sequences": "--val-sequences",
    "text_field": "--text-field",
    "accept_invalid_utf8": "--accept-invalid-utf8",
    "gutenberg_strip": "--no-gutenberg-strip",
    "seq_len": "--seq-len",
    "varlen": "--varlen",
    "data_seed": "--data-seed",
    "tokenizer": "--tokenizer",
    "vocab_size": "--vocab-size",
    "tokenizer_train_chars": "--tokenizer-train-chars",
    "batch_tokens": "--batch-tokens",
}
# Options a resumed run may change: how the same steps are computed, reported and kept.
RESUME_FREE = {
    "threads": "--threads",
    "progress": "--no-progress",
    "log_every": "--log-every",
    "val_every": "--val-every",
    "save_every": "--save-every",
    "time_limit": "--time-limit",
    "keep_checkpoints": "--keep-checkpoints",
    "cache_dir": "--cache-dir",
    "device": "--device",
    "precision": "--precision",
    "fsdp": "--fsdp",
    "context_parallel": "--context-parallel",
    "micro_batch_size": "--micro-batch-size",
    "grad_checkpointing": "--grad-checkpointing",
    "on_nonfinite": "--on-nonfinite",
}
_FLAG_SET_WHEN = {"gutenberg_strip": False}  # flags that store False when given (--no-...)


def stored_train_args(run_dir: str) -> dict | None:
    """The run's ``train_args.json`` (``None`` when it has none).

    Raises:
        UsageError: the file is not readable JSON (--resume).
    """
    path = os.path.join(run_dir, "train_args.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: unreadable ({e}) (--resume)") from None
    if not isinstance(stored, dict):
        raise UsageError(f"{path}: expected a JSON object of efla train options (--resume)")
    check.known_keys(stored, {*TrainConfig.__dataclass_fields__, "resolved"}, path, "--resume")
    return stored


def check_resume_unchanged(stored: dict, given: dict) -> None:
    """Refuses any option of :data:`RESUME_FIXED` in ``given`` whose value differs from the run's ``stored`` one.

    Raises:
        UsageError: naming the option, its stored value and the given one.
    """
    for name, option in RESUME_FIXED.items():
        if name not in stored or name not in given:
            continue
        if _comparable(name, stored[name]) != _comparable(name, given[name]):
            raise UsageError(
                f"{option} was {_shown(name, stored[name])} in this run, got {_shown(name, given[name])}; "
                f"--resume continues the run on disk ({option})"
            )


def _comparable(name: str, value):
    if name in ("data", "val_data"):
        return [_local_path(p) for p in value] if value else None
    if name == "tokenizer":
        return None if value in (None, "", "bpe") else _local_path(value)
    if name == "config_file":
        return _local_path(value) if value else None
    if isinstance(value, tuple):
        return list(value)
    return value


def _local_path(path: str) -> str:
    if path.startswith("hf:") or not _looks_local(path):
        return path
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _shown(name: str, value) -> str:
    if name in _FLAG_SET_WHEN or isinstance(value, bool):
        return "given" if value == _FLAG_SET_WHEN.get(name, True) else "not given"
    if value is None:
        return "not given"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)
