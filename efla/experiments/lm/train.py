"""Language-model training (efla.md §3 recipe): one process on a CPU to many GPUs under torchrun.

:func:`train` is the whole loop; ``efla train`` (efla/commands/train.py) only parses arguments.

Recipe defaults (the paper's): AdamW (betas 0.9/0.95, eps 1e-8), peak lr 3e-4, linear warm-up from
3e-5 to 3e-4 over the first 1/8 of the steps (the paper warms up over 1B of 8B tokens), cosine decay to
3e-5 at the last step, weight decay 0.1 (on matrices and embeddings; not on norms, biases and the gate
parameters ``A_log``/``dt_bias``), gradient clipping at 1.0. The batch is given in tokens; what does not
fit one forward per rank is accumulated.

Loss normalisation: the step loss is the mean next-token cross-entropy over every prediction of the
global batch. Each micro-batch's mean loss is weighted by its share of the global predictions (times the
world size, as DDP/FSDP average gradients over ranks), so 1 process with accumulation, N processes, or
packed varlen batches all optimise the same quantity.

Output directory ``out``:
    ``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files: a Hugging Face
    model directory (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` after ``import efla``);
    ``log.jsonl``: one JSON object per logged step (loss, lr, grad norm, tokens, tokens/s, val loss);
    ``train_args.json``, ``train_summary.json``; ``checkpoints/step-NNNNNNN/``: ``model.safetensors``,
    ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` (every rank's RNG states; all three hold tensors and
    plain values only and load with ``torch.load(weights_only=True)``, so a crafted pickle is refused,
    never run), ``trainer_state.json`` (step, data position, data fingerprint, learning-rate schedule
    and optimizer settings) and ``manifest.json`` (size and SHA-256 of every file, written last).
    ``.efla-run.lock``: marks the directory as a run and locks it while a run uses it
    (:mod:`efla.experiments.run_dir`). A checkpoint is written in ``checkpoints/.tmp-...`` and renamed into place, so a
    crash never leaves a half-written checkpoint under a ``step-`` name; one whose files do not match
    their manifest is refused (:class:`CheckpointError`, naming the newest good one).

Resuming (``resume=True``) loads the newest checkpoint and continues: the data position, RNG states,
optimizer and scheduler are restored, so on a CPU the per-step losses equal the uninterrupted run's bit
for bit (same thread count and library versions). Without a checkpoint it stops (``resume_or_start``
starts a new run then). The learning-rate schedule and optimizer settings are the checkpoint's: a
change is refused, except a larger ``max_steps`` with ``extend_at_min_lr``, which finishes the saved
schedule and trains the extra steps at ``min_lr`` (:func:`scheduled_lr`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from efla.errors import UsageError

from .. import arg_checks as check
from .. import harness
from ..run_dir import check_out_dir, claim_run_dir

__all__ = [
    "TrainConfig",
    "CheckpointError",
    "check_train_config",
    "load_checkpoint_state",
    "scheduled_lr",
    "NonFiniteLossError",
    "train",
    "lr_at",
    "list_checkpoints",
    "verify_checkpoint",
    "find_resume_checkpoint",
    "read_log",
    "SIZE_DEFAULTS",
    "main_ddp_cleanup",
]

# Per model size: (sequence length, batch size in tokens). 340m/1.3b: the paper's 2K x 512 = 1M tokens.
SIZE_DEFAULTS = {"tiny": (256, 16 * 256), "340m": (2048, 1 << 20), "1.3b": (2048, 1 << 20)}
CKPT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupted (or none can be resumed from)."""


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) of a step was NaN or infinite; the step was not applied."""


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


# -- distributed -------------------------------------------------------------------------------------

@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.enabled:
            torch.distributed.barrier()

    def broadcast(self, obj):
        if not self.enabled:
            return obj
        lst = [obj]
        torch.distributed.broadcast_object_list(lst, src=0)
        return lst[0]

    def all_gather(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def _init_dist(device_kind: str) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    return _Dist(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(),
                 local_rank=int(os.environ.get("LOCAL_RANK", "0")), enabled=True)


# -- schedule ----------------------------------------------------------------------------------------

def lr_at(step: int, max_steps: int, warmup_steps: int, lr: float, min_lr: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up from ``min_lr`` to ``lr`` over
    ``warmup_steps`` updates, then cosine from ``lr`` down to ``min_lr`` at the last update."""
    if step < warmup_steps:
        return min_lr + (lr - min_lr) * step / warmup_steps
    span = max(1, max_steps - 1 - warmup_steps)
    p = min(1.0, (step - warmup_steps) / span)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def scheduled_lr(step: int, schedule: dict) -> float:
    """Learning rate of update ``step`` under ``schedule`` (``planned_steps``, ``warmup``, ``lr``,
    ``min_lr``): :func:`lr_at` over the planned steps, then ``min_lr`` for any steps past them (a run
    extended with ``extend_at_min_lr``)."""
    if step >= schedule["planned_steps"]:
        return schedule["min_lr"]
    return lr_at(step, schedule["planned_steps"], schedule["warmup"], schedule["lr"], schedule["min_lr"])


# -- checkpoint files --------------------------------------------------------------------------------

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json_atomic(path: str, obj) -> None:
    harness.atomic_write_json(path, obj, indent=2)


def _step_of(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


def list_checkpoints(out: str) -> list[str]:
    """Checkpoint directories under ``out/checkpoints`` (``step-N``), oldest first; temporary ones skipped."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = [(s, os.path.join(root, n)) for n in os.listdir(root) if (s := _step_of(n)) is not None]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str) -> dict:
    """The checkpoint's manifest after checking every file's size and SHA-256 against it.

    Raises:
        CheckpointError: manifest missing or unreadable, a file missing, truncated or changed.
    """
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: no manifest.json (an incomplete checkpoint)")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: manifest.json is unreadable ({e})") from e
    for name in CKPT_FILES:
        if name not in files:
            raise CheckpointError(f"{path}: manifest.json does not list {name}")
    for name, meta in files.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path}: {name} is missing")
        size = os.path.getsize(fp)
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)")
        if _sha256(fp) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in manifest.json (corrupted)")
    return manifest


def find_resume_checkpoint(out: str) -> str | None:
    """The newest checkpoint under ``out``, verified; ``None`` when there is none.

    Raises:
        CheckpointError: the newest one is damaged; the message names the newest good one (if any)
            and how to resume from it.
    """
    ckpts = list_checkpoints(out)
    if not ckpts:
        return None
    latest = ckpts[-1]
    try:
        verify_checkpoint(latest)
        return latest
    except CheckpointError as e:
        good = None
        for p in reversed(ckpts[:-1]):
            try:
                verify_checkpoint(p)
                good = p
                break
            except CheckpointError:
                continue
        hint = (f"The previous good checkpoint is {good}: resume from it with --resume-from {good} "
                f"(or delete {latest})." if good else "No earlier good checkpoint exists.")
        raise CheckpointError(f"refusing to resume from the latest checkpoint: {e}. {hint}") from e


def _rng_state() -> dict:
    """This process's RNG states as tensors, ints and lists only (loadable with ``weights_only=True``)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
          "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    """Restores :func:`_rng_state` (or the numpy-array form of checkpoints written before it)."""
    version, mt_state, gauss = st["python"]
    random.setstate((version, tuple(int(x) for x in _as_list(mt_state)), gauss))
    kind, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((kind, np.asarray(_as_list(keys), dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def load_checkpoint_state(path: str):
    """A checkpoint's ``.pt`` file without running any code from it (``torch.load(weights_only=True)``:
    tensors, numbers, strings and containers only).

    Raises:
        CheckpointError: the file holds anything else (a crafted pickle, or an object that needs code).
    """
    import pickle  # noqa: PLC0415

    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):  # RNG states of checkpoints before 0.1.1
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "unsupported global" in ln.lower()), lines[-1] if lines else type(e).__name__)
        raise CheckpointError(f"{path}: refused: it holds more than tensors and plain values, and loading it "
                              f"could run code ({reason[:200]})") from None


_NUMPY_CORE = getattr(np, "_core", None) or np.core
_NUMPY_ARRAY_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


# -- model / state helpers ---------------------------------------------------------------------------

def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _full_model_state(model, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to("cpu") for k, v in _unwrap(model).state_dict().items()}


def _full_optim_state(model, optimizer, fsdp: bool) -> dict:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith(("A_log", "dt_bias")):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def read_log(out: str) -> list[dict]:
    """The entries of ``out/log.jsonl``."""
    path = os.path.join(out, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_log(out: str, step: int) -> None:
    path = os.path.join(out, "log.jsonl")
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                break  # a torn last line from a crash
    harness.atomic_write(path, "".join(keep))


def _size_of(preset: str | None) -> str:
    if preset is None:
        return "tiny"
    key = preset.strip().lower().replace("_", "-")
    for size in SIZE_DEFAULTS:
        if key.startswith(size + "-"):
            return size
    return "tiny"


def _model_config(cfg: TrainConfig, tok, eos_id: int):
    from efla.models import EFLAConfig, get_preset_config  # noqa: PLC0415

    ids = dict(vocab_size=len(tok), eos_token_id=eos_id,
               bos_token_id=getattr(tok, "bos_token_id", None), pad_token_id=getattr(tok, "pad_token_id", None))
    if cfg.config_file:
        with open(cfg.config_file) as f:
            d = json.load(f)
        d.pop("model_type", None)
        d.pop("architectures", None)
        d.update(ids)
        return EFLAConfig(**d)
    if not cfg.preset:
        raise ValueError("preset / config_file: give one")
    return get_preset_config(cfg.preset, **ids)


# -- schedule on resume ------------------------------------------------------------------------------

_OPTION_OF = {"planned_steps": "--max-steps", "warmup": "--warmup-steps", "lr": "--lr", "min_lr": "--min-lr",
              "weight_decay": "--weight-decay", "betas": "betas", "eps": "eps", "grad_clip": "--grad-clip"}


def _schedule_of(cfg: TrainConfig, r: dict) -> dict:
    return dict(planned_steps=r["max_steps"], warmup=r["warmup"], lr=cfg.lr, min_lr=cfg.min_lr)


def _hyperparameters(cfg: TrainConfig) -> dict:
    return dict(weight_decay=cfg.weight_decay, betas=list(cfg.betas), eps=cfg.eps, grad_clip=cfg.grad_clip)


def _saved_settings(ckpt: str, state: dict, out: str) -> dict:
    """Schedule and optimizer settings the checkpoint was trained with (older checkpoints: from
    ``train_args.json`` beside it)."""
    if "schedule" in state:
        return dict(state["schedule"], **state.get("hyperparameters", {}))
    saved = dict(planned_steps=state.get("max_steps"))
    args_path = os.path.join(out, "train_args.json")
    if os.path.isfile(args_path):
        with open(args_path) as f:
            args = json.load(f)
        saved.update({k: args[k] for k in ("lr", "min_lr", "weight_decay", "eps", "grad_clip") if k in args})
        saved["betas"] = list(args.get("betas", [])) or None
        saved["warmup"] = args.get("resolved", {}).get("warmup")
    return {k: v for k, v in saved.items() if v is not None}


def _resumed_schedule(cfg: TrainConfig, r: dict, ckpt: str, state: dict) -> dict:
    """The schedule a resumed run continues: the checkpoint's own. A larger ``max_steps`` with
    ``extend_at_min_lr`` keeps it to its planned end and trains the extra steps at ``min_lr``.

    Raises:
        UsageError: any other change of the schedule or optimizer settings (named with both values).
    """
    saved = _saved_settings(ckpt, state, cfg.out)
    now = dict(_schedule_of(cfg, r), **_hyperparameters(cfg))
    if cfg.warmup_steps is None:  # derived from the length: the saved run's own
        now["warmup"] = saved.get("warmup", now["warmup"])
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    extended = "planned_steps" in changed and cfg.extend_at_min_lr and now["planned_steps"] > saved["planned_steps"]
    if extended:
        changed.remove("planned_steps")
    if changed:
        what = ", ".join(f"{_OPTION_OF[k]} {saved[k]} -> {now[k]}" for k in changed)
        hint = ("; to train longer, pass --extend-at-min-lr (the saved schedule runs to its end, the extra steps "
                "train at --min-lr)" if changed == ["planned_steps"] and now["planned_steps"] > saved["planned_steps"]
                else "")
        raise UsageError(f"{ckpt} was trained with other settings ({what}); a resumed run keeps them{hint} (--resume)")
    return {k: saved.get(k, now[k]) for k in ("planned_steps", "warmup", "lr", "min_lr")}


# -- the loop ----------------------------------------------------------------------------------------

def _resolve(cfg: TrainConfig, dist: _Dist) -> dict:
    size = _size_of(cfg.preset)
    seq_len = cfg.seq_len or SIZE_DEFAULTS[size][0]
    batch_tokens = cfg.batch_tokens or SIZE_DEFAULTS[size][1]
    if batch_tokens % seq_len:
        raise UsageError(f"{batch_tokens} tokens are not a whole number of {seq_len}-token sequences "
                         "(--batch-tokens, --seq-len)")
    global_seqs = batch_tokens // seq_len
    data_world = dist.world // max(1, cfg.context_parallel)  # ranks that take different sequences
    if global_seqs % data_world:
        raise UsageError(f"{global_seqs} sequences per step do not split over {data_world} ranks (--batch-tokens)")
    per_rank = global_seqs // data_world
    mb = min(cfg.micro_batch_size or per_rank, per_rank)
    if per_rank % mb:
        raise UsageError(f"{mb} does not divide the {per_rank} sequences per rank and step (--micro-batch-size)")
    if cfg.max_steps is None and cfg.max_tokens is None:
        raise UsageError("give the length of the run (--max-steps or --max-tokens)")
    max_steps = cfg.max_steps if cfg.max_steps is not None else max(1, cfg.max_tokens // batch_tokens)
    if max_steps < 1:
        raise UsageError(f"expected >= 1, got {max_steps} (--max-steps)")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max_steps // 8
    if cfg.on_nonfinite not in ("stop", "skip"):
        raise UsageError(f"expected 'stop' or 'skip', got {cfg.on_nonfinite!r} (--on-nonfinite)")
    return dict(seq_len=seq_len, batch_tokens=batch_tokens, global_seqs=global_seqs, per_rank=per_rank,
                micro=mb, accum=per_rank // mb, max_steps=max_steps, warmup=warmup)


def _prepare_tokenizer(cfg: TrainConfig, dist: _Dist, resuming: bool):
    from efla.data.text import read_documents  # noqa: PLC0415
    from efla.data.tokenizer import get_tokenizer, load_tokenizer  # noqa: PLC0415

    have = os.path.exists(os.path.join(cfg.out, "tokenizer_config.json"))
    if not (resuming and have) and dist.main:
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


def _load_data(cfg: TrainConfig, r: dict, tok, eos_id: int, dist: _Dist):
    from efla.data.text import load_token_stream, split_train_val  # noqa: PLC0415

    cache = cfg.cache_dir or os.path.join(cfg.out, "cache")
    # rank 0 tokenizes (and fills the cache) first; the others then read the cache
    toks = val_toks = None
    for turn in ((True,), (False,)):
        if dist.main == turn[0]:
            toks = load_token_stream(cfg.data, tok, eos_id, cache, cfg.text_field, cfg.gutenberg_strip,
                                     cfg.accept_invalid_utf8)
            if cfg.val_data:
                val_toks = load_token_stream(cfg.val_data, tok, eos_id, cache, cfg.text_field, cfg.gutenberg_strip,
                                             cfg.accept_invalid_utf8)
        dist.barrier()
    return split_train_val(toks, r["seq_len"], cfg.val_sequences, val_seed=1234, val_tokens=val_toks)


def _evaluate(model, val, r: dict, dist: _Dist, eos_id: int, varlen: bool, autocast) -> float | None:
    from efla.data.text import count_targets, make_batch  # noqa: PLC0415

    if val is None or len(val) == 0:
        return None
    n = (len(val) // dist.world) * dist.world
    if n == 0:
        return None
    idx = np.arange(n)[dist.rank * (n // dist.world): (dist.rank + 1) * (n // dist.world)]
    core = model  # the bare model (DDP) or the FSDP root (every rank takes part in its all-gathers)
    was = core.training
    core.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    dev = next(core.parameters()).device
    with torch.no_grad():
        for s in range(0, len(idx), r["micro"]):
            batch = make_batch(val.sequences(idx[s: s + r["micro"]]), eos_id, varlen)
            batch = {k: v.to(dev) for k, v in batch.items()}
            try:
                with autocast():
                    loss = core(**batch, use_cache=False).loss
            except ValueError as e:  # non-finite weights (every rank has the same ones)
                if "non-finite" not in str(e):
                    raise
                core.train(was)
                return float("nan")
            c = count_targets(batch)
            tot += torch.tensor([loss.double().item() * c, c], dtype=torch.float64)
    if dist.enabled:
        t = tot.to(dev) if dev.type == "cuda" else tot
        torch.distributed.all_reduce(t)
        tot = t.cpu()
    core.train(was)
    return float(tot[0] / tot[1]) if tot[1] > 0 else None


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
    check.at_least(cfg.keep_checkpoints, 1, "--keep-checkpoints")
    check.at_least(cfg.threads, 1, "--threads")


def _check_model_choice(cfg: TrainConfig) -> None:
    from efla.models import EFLAConfig, get_preset_config  # noqa: PLC0415

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
        raise UsageError("context parallelism splits only linear-attention layers; this model has softmax-attention "
                         f"layers {model_config.attn['layers']} (--context-parallel)")


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
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    return fields


def _check_paths(cfg: TrainConfig) -> None:
    from efla.data.text import expand_paths  # noqa: PLC0415

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


def _check_text(cfg: TrainConfig, dist: _Dist) -> None:
    from efla.data.text import check_text_files  # noqa: PLC0415

    def warn(message: str) -> None:
        if dist.main:
            print(f"efla train: warning: {message}", file=sys.stderr)

    check_text_files(cfg.data, cfg.accept_invalid_utf8, warn, option="--data")
    check_text_files(cfg.val_data or [], cfg.accept_invalid_utf8, warn, option="--val-data")


def _choose_start(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from (``None``: a fresh start); read-only.

    Raises:
        CheckpointError: a damaged checkpoint. UsageError: nothing to resume, or a run that would be
        clobbered.
    """
    if cfg.resume_from:
        verify_checkpoint(cfg.resume_from)
        return cfg.resume_from
    if cfg.resume or cfg.resume_or_start:
        ckpt = find_resume_checkpoint(cfg.out)
        if ckpt is None and not cfg.resume_or_start:
            raise UsageError(f"{cfg.out} has no checkpoint to resume from; pass --resume-or-start to start a new "
                             "run when there is none (--resume)")
        return ckpt
    if list_checkpoints(cfg.out) and not cfg.overwrite:
        raise UsageError(f"{cfg.out} already has checkpoints: pass --resume to continue that run, --overwrite to "
                         "start again, or another --out (--out)")
    return None


def _clear_for_fresh_start(cfg: TrainConfig) -> None:
    if cfg.overwrite:
        shutil.rmtree(os.path.join(cfg.out, "checkpoints"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(cfg.out, "log.jsonl"))


def _claim_and_choose_start(cfg: TrainConfig, dist: _Dist):
    """Rank 0 checks ``out``, locks it and picks the checkpoint; every rank gets the outcome.

    Returns ``(lock or None, checkpoint or None)``; on an error the lock is released and a directory
    created here is removed again, so a refused run leaves nothing behind."""
    lock, ckpt, error = None, None, None
    if dist.main:
        existed = os.path.exists(cfg.out)
        try:
            check_out_dir(cfg.out, cfg.overwrite)
            lock = claim_run_dir(cfg.out)
            if lock.stale_holder:
                print(f"efla train: took over the lock of a run that is no longer running "
                      f"(pid {lock.stale_holder.get('pid')}) in {cfg.out}", file=sys.stderr)
            ckpt = _choose_start(cfg)
            if ckpt is None:
                _clear_for_fresh_start(cfg)
        except (UsageError, CheckpointError) as e:
            error = e
            _undo_claim(cfg.out, lock, existed)
            lock = None
    error, ckpt = dist.broadcast((error, ckpt))
    if error is not None:
        raise error
    return lock, ckpt


def _undo_claim(out: str, lock, existed: bool) -> None:
    from ..run_dir import LOCK_NAME  # noqa: PLC0415

    if lock is None:
        return
    lock.release()
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(out, LOCK_NAME))
            os.rmdir(out)


STEADY_STATE_WARMUP = 5


def train(cfg: TrainConfig, on_step_end: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a language model; returns the run's summary (also ``out/train_summary.json``).

    ``on_step_end(step, entry)`` is called on every rank after each update (and after that step's
    checkpoint, if any); an exception raised there ends the run as a crash would.

    Everything that can be checked before work starts is checked first (:func:`check_train_config`,
    the text files, the output directory, the checkpoint to resume); a refused run writes nothing.
    The output directory is locked for the whole run (:mod:`efla.experiments.run_dir`).

    Returns:
        dict with ``losses`` (every step of the whole run, resumed ones included, read back from the
        log on rank 0), ``val_loss``, ``tokens_per_s`` (steady-state training throughput of all ranks
        together, see :func:`throughput`), ``tokens_per_s_all_steps``, ``peak_memory_gib_per_gpu`` (one
        entry per rank; ``None`` off the GPU), ``steps``, ``tokens``, ``resumed_from``, ``out``. Each
        ``log.jsonl`` entry carries that step's ``tokens_per_s`` and, on the GPU, ``peak_memory_gib``
        (this rank's peak so far).

    Raises:
        UsageError: an option, path or input file is wrong; ``out`` is not an efla run, is locked by
            another run, or has nothing to resume; a resumed run's schedule would change.
        CheckpointError: resuming from a damaged or unsafe checkpoint (names the previous good one).
        NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (the last good checkpoint stays).
    """
    check_train_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev_kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dist = _init_dist(dev_kind)
    device = torch.device(f"cuda:{dist.local_rank}" if dev_kind == "cuda" else dev_kind)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cp = None
    if cfg.context_parallel > 1:
        from efla.distributed import setup_context_parallel  # noqa: PLC0415

        cp = setup_context_parallel(cfg.context_parallel, fsdp=cfg.fsdp, grad_checkpointing=cfg.grad_checkpointing)
    r = _resolve(cfg, dist)
    _check_text(cfg, dist)
    lock, ckpt = _claim_and_choose_start(cfg, dist)
    try:
        return _train_from(cfg, dist, device, r, ckpt, on_step_end, cp)
    finally:
        if lock is not None:
            lock.release()


def _train_from(cfg: TrainConfig, dist: _Dist, device, r: dict, ckpt: str | None, on_step_end, cp=None) -> dict:
    from efla.distributed import context_parallel_lm_loss  # noqa: PLC0415
    from efla.data.text import SequenceOrder, count_targets, make_batch, rank_slice  # noqa: PLC0415
    from efla.data.tokenizer import tokenizer_eos_id  # noqa: PLC0415
    from efla.models import EFLAForCausalLM  # noqa: PLC0415

    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    state = None
    schedule = _schedule_of(cfg, r)
    if ckpt is not None:
        with open(os.path.join(ckpt, "trainer_state.json")) as f:
            state = json.load(f)
        schedule = _resumed_schedule(cfg, r, ckpt, state)

    # -- tokenizer, data, model --------------------------------------------------------------------
    tok = _prepare_tokenizer(cfg, dist, resuming=ckpt is not None)
    eos_id = tokenizer_eos_id(tok)
    train_data, val_data = _load_data(cfg, r, tok, eos_id, dist)
    order = SequenceOrder(len(train_data), seed=cfg.data_seed)
    if state is not None and state["data"]["fingerprint"] != train_data.fingerprint():
        raise CheckpointError(f"{ckpt}: the training data differs from the checkpoint's (fingerprint "
                              f"{train_data.fingerprint()} vs {state['data']['fingerprint']}); resume with the same "
                              "--data, tokenizer and --seq-len")

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    mconf = _model_config(cfg, tok, eos_id)
    model = EFLAForCausalLM(mconf)
    if ckpt is not None:
        from safetensors.torch import load_file  # noqa: PLC0415

        model.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")))
    model.to(device).train()
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())

    use_autocast = precision == "bf16" and not cfg.fsdp
    if cfg.fsdp:
        if not dist.enabled:
            raise ValueError("fsdp: needs torchrun (WORLD_SIZE > 1)")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        for block in model.model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        wrapped = model
    elif dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        wrapped = model

    def autocast():
        if use_autocast:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                                  eps=cfg.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scheduled_lr(s, schedule) / cfg.lr)
    start_step, tokens_seen = 0, 0
    if ckpt is not None:
        osd = load_checkpoint_state(os.path.join(ckpt, "optimizer.pt"))
        if cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                StateDictOptions,
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(wrapped, optimizer, osd, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(osd)
        scheduler.load_state_dict(load_checkpoint_state(os.path.join(ckpt, "scheduler.pt")))
        rng = load_checkpoint_state(os.path.join(ckpt, "rng.pt"))
        # the loop draws no random numbers (no dropout; the data order is a function of the position), so
        # a different world size only loses bitwise equality with the original run, not correctness
        _set_rng_state(rng[dist.rank] if len(rng) == dist.world else rng[0])
        start_step, tokens_seen = state["step"], state["tokens"]
        if state["data"]["position"] != start_step * r["global_seqs"]:
            raise CheckpointError(f"{ckpt}: saved with {state['data']['position'] // max(1, start_step)} sequences "
                                  f"per step, resuming with {r['global_seqs']}: resume with the same --batch-tokens "
                                  "and --seq-len")
        if dist.main:
            _truncate_log(cfg.out, start_step)

    if dist.main:
        args = dataclasses.asdict(cfg)
        args["resolved"] = dict(r, schedule=schedule, world_size=dist.world, precision=precision, device=str(device),
                                n_params=n_params, vocab_size=len(tok), train_sequences=len(train_data),
                                train_tokens_available=len(train_data) * r["seq_len"],
                                val_sequences=len(val_data) if val_data is not None else 0)
        _write_json_atomic(os.path.join(cfg.out, "train_args.json"), args)

    def save_checkpoint(step: int, position: int) -> str | None:
        msd = _full_model_state(wrapped, cfg.fsdp)
        osd = _full_optim_state(wrapped, optimizer, cfg.fsdp)
        rngs = dist.all_gather(_rng_state())
        path = None
        if dist.main:
            from safetensors.torch import save_file  # noqa: PLC0415

            root = os.path.join(cfg.out, "checkpoints")
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, f"step-{step:07d}")
            tmp = os.path.join(root, f".tmp-step-{step:07d}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            save_file({k: v.contiguous() for k, v in msd.items()}, os.path.join(tmp, "model.safetensors"),
                      metadata={"format": "pt"})
            torch.save(osd, os.path.join(tmp, "optimizer.pt"))
            torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
            torch.save(rngs, os.path.join(tmp, "rng.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(dict(step=step, tokens=step * r["batch_tokens"], max_steps=r["max_steps"],
                               world_size=dist.world, schedule=schedule, hyperparameters=_hyperparameters(cfg),
                               data=dict(position=position, seq_len=r["seq_len"], data_seed=cfg.data_seed,
                                         n_sequences=len(train_data), fingerprint=train_data.fingerprint(),
                                         epoch=order.epoch_of(position)),
                               model_config=mconf.to_dict()), f, indent=2)
            files = {}
            for name in CKPT_FILES:
                fp = os.path.join(tmp, name)
                with open(fp, "rb") as fh:
                    os.fsync(fh.fileno())
                files[name] = dict(bytes=os.path.getsize(fp), sha256=_sha256(fp))
            _write_json_atomic(os.path.join(tmp, "manifest.json"), dict(format=1, step=step, files=files))
            _fsync_dir(tmp)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.rename(tmp, path)
            _fsync_dir(root)
            for old in list_checkpoints(cfg.out)[:-max(1, cfg.keep_checkpoints)]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    # -- training ----------------------------------------------------------------------------------
    G, L = r["global_seqs"], r["seq_len"]
    bar = None
    if dist.main and cfg.progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=r["max_steps"], initial=start_step, desc=f"train {os.path.basename(cfg.out.rstrip('/'))}",
                   dynamic_ncols=True, unit="step")
    log_f = open(os.path.join(cfg.out, "log.jsonl"), "a") if dist.main else None  # noqa: SIM115
    train_time, t_mark = 0.0, time.perf_counter()
    step_seconds: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    last_good = ckpt
    val_loss = None
    step = start_step
    try:
        while step < r["max_steps"]:
            t0 = time.perf_counter()
            global_idx = order.take(step * G, G)
            if cfg.varlen:
                n_global = sum(count_targets(make_batch(train_data.sequences(global_idx[i: i + 1]), eos_id, True))
                               for i in range(G))
            else:
                n_global = G * (L - 1)
            data_rank, data_world = (cp.data_rank, cp.data_world) if cp else (dist.rank, dist.world)
            mine = rank_slice(global_idx, data_rank, data_world)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            forward_error = None
            for i in range(r["accum"]):
                batch = make_batch(train_data.sequences(mine[i * r["micro"]: (i + 1) * r["micro"]]), eos_id,
                                   cfg.varlen)
                n_mb = count_targets(batch)
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                last = i == r["accum"] - 1
                if cfg.fsdp:
                    wrapped.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext()
                elif dist.enabled and not last:
                    sync = wrapped.no_sync()
                else:
                    sync = contextlib.nullcontext()
                try:
                    with sync:
                        with autocast():
                            loss = (context_parallel_lm_loss(wrapped, batch, cp) if cp
                                    else wrapped(**batch, use_cache=False).loss)
                        (loss * (n_mb * dist.world / n_global)).backward()
                except ValueError as e:  # the ops refuse non-finite inputs (always on CPU)
                    if "non-finite" not in str(e):
                        raise
                    forward_error = str(e)
                    break
                loss_sum += loss.detach().double() * n_mb
            if forward_error is not None:
                loss_sum.fill_(float("nan"))
                if dist.enabled and cfg.on_nonfinite == "skip":  # the other ranks wait in collectives: cannot skip
                    raise NonFiniteLossError(f"non-finite values in the forward at step {step + 1} on rank "
                                             f"{dist.rank} ({forward_error}); --on-nonfinite skip needs the loss to "
                                             "be the first non-finite value under torchrun")
            elif dist.enabled:
                torch.distributed.all_reduce(loss_sum)
            step_loss = float(loss_sum.cpu() / n_global)
            if forward_error is None:
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                if hasattr(gnorm, "full_tensor"):
                    gnorm = gnorm.full_tensor()
                gnorm = float(gnorm)
            else:
                gnorm = float("nan")
            lr_used = optimizer.param_groups[0]["lr"]
            skipped = False
            if not (math.isfinite(step_loss) and math.isfinite(gnorm)):
                optimizer.zero_grad(set_to_none=True)
                if cfg.on_nonfinite == "stop":
                    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
                    msg = (f"non-finite {'loss' if not math.isfinite(step_loss) else 'gradient norm'} at step "
                           f"{step + 1} (loss {step_loss}, grad norm {gnorm}"
                           + (f"; in the forward: {forward_error}" if forward_error else "")
                           + f"); the update was not applied and the run stopped; {where}. Lower --lr, or pass "
                           "--on-nonfinite skip to skip such batches.")
                    if log_f:
                        log_f.write(json.dumps(dict(step=step + 1, loss=step_loss, grad_norm=gnorm,
                                                    error="non-finite")) + "\n")
                        log_f.flush()
                    raise NonFiniteLossError(msg)
                skipped = True
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            tokens_seen = step * r["batch_tokens"]
            dt = time.perf_counter() - t0
            train_time += dt
            step_seconds.append(dt)
            tps = r["batch_tokens"] / dt if dt > 0 else 0.0
            entry = dict(step=step, loss=step_loss, lr=lr_used, grad_norm=gnorm, tokens=tokens_seen,
                         tokens_per_s=tps, step_s=dt, epoch=order.epoch_of(step * G))
            if device.type == "cuda":
                entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
            if skipped:
                entry["skipped"] = "non-finite"
                if bar is not None:
                    bar.write(f"step {step}: non-finite loss/grad ({step_loss}, {gnorm}); batch skipped")
            if (cfg.val_every and step % cfg.val_every == 0) or step == r["max_steps"]:
                val_loss = _evaluate(wrapped if cfg.fsdp else model, val_data, r, dist, eos_id, cfg.varlen, autocast)
                if val_loss is not None:
                    entry["val_loss"] = val_loss
            if log_f and (step % cfg.log_every == 0 or step == r["max_steps"] or "val_loss" in entry or skipped):
                log_f.write(json.dumps(entry) + "\n")
                log_f.flush()
            if bar is not None:
                post = dict(loss=f"{step_loss:.4f}", tok_s=f"{tps:,.0f}", lr=f"{lr_used:.2e}")
                if val_loss is not None:
                    post["val"] = f"{val_loss:.4f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if (cfg.save_every and step % cfg.save_every == 0) or step == r["max_steps"]:
                last_good = save_checkpoint(step, step * G) or last_good
            if on_step_end is not None:
                on_step_end(step, entry)
    finally:
        if bar is not None:
            bar.close()
        if log_f:
            log_f.close()

    # -- final model directory ---------------------------------------------------------------------
    peak_per_gpu = peak_memory_per_gpu(device, dist)
    msd = _full_model_state(wrapped, cfg.fsdp) if cfg.fsdp else None
    summary = None
    if dist.main:
        core = _unwrap(model)
        if msd is not None:
            core.save_pretrained(cfg.out, state_dict=msd)
        else:
            core.save_pretrained(cfg.out)
        tok.save_pretrained(cfg.out)
        log = read_log(cfg.out)
        losses = [e["loss"] for e in log if "error" not in e]
        summary = dict(out=cfg.out, steps=step, tokens=tokens_seen, max_steps=r["max_steps"],
                       resumed_from=ckpt, final_loss=losses[-1] if losses else None, val_loss=val_loss,
                       **throughput(step_seconds, r["batch_tokens"]), peak_memory_gib_per_gpu=peak_per_gpu,
                       train_seconds_this_process=train_time, wall_seconds_this_process=time.perf_counter() - t_mark,
                       n_params=n_params, world_size=dist.world, device=str(device), precision=precision,
                       threads=torch.get_num_threads(), variant=mconf.variant)
        _write_json_atomic(os.path.join(cfg.out, "train_summary.json"), summary)
        summary = dict(summary, losses=losses, log=log)
    dist.barrier()
    return summary if summary is not None else dict(out=cfg.out, steps=step)


def warmup_steps(n_steps: int) -> int:
    """Steps left out of the steady-state rate: the first ones compile and autotune kernels (the first
    GPU steps can take minutes); at most half of the steps this process ran."""
    return min(STEADY_STATE_WARMUP, n_steps // 2)


def throughput(step_seconds: list[float], batch_tokens: int) -> dict:
    """``tokens_per_s``: the steady-state rate (all ranks' tokens per second over the steps after the
    warm-up steps); ``tokens_per_s_all_steps``: the rate over every step this process ran."""
    if not step_seconds:
        return dict(tokens_per_s=None, tokens_per_s_all_steps=None, steady_state_steps=0)
    steady = step_seconds[warmup_steps(len(step_seconds)):]
    return dict(tokens_per_s=len(steady) * batch_tokens / sum(steady),
                tokens_per_s_all_steps=len(step_seconds) * batch_tokens / sum(step_seconds),
                steady_state_steps=len(steady))


def peak_memory_per_gpu(device: torch.device, dist) -> list[float] | None:
    """Each rank's peak allocated GPU memory (GiB) over the training steps; ``None`` off the GPU."""
    if device.type != "cuda":
        return None
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2 ** 30], device=device, dtype=torch.float64)
    if not dist.enabled:
        return [float(mine)]
    every = [torch.zeros_like(mine) for _ in range(dist.world)]
    torch.distributed.all_gather(every, mine)
    return [float(x) for x in every]


def main_ddp_cleanup() -> None:
    """Destroy the process group if this process created one (call at exit under torchrun)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `efla train` (python -m efla train)")
