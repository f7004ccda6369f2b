"""Run state the experiments share: checkpoints written whole or not at all, verified before a
resume, loaded without running code (``efla train``'s checkpoint directories; MAD's partial runs
load through ``load_checkpoint_state``).

A checkpoint ``out/checkpoints/step-NNNNNNN/`` holds ``model.safetensors``, ``optimizer.pt``,
``scheduler.pt``, ``rng.pt``, ``trainer_state.json`` and, written last, ``manifest.json`` (size and
SHA-256 of every file). It is written in ``checkpoints/.tmp-...`` and renamed into place, so a crash
never leaves a half-written checkpoint under a ``step-`` name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

from efla.errors import CheckpointError

from efla import records

__all__ = [
    "CKPT_FILES",
    "CheckpointError",
    "list_checkpoints",
    "verify_checkpoint",
    "find_resume_checkpoint",
    "load_checkpoint_state",
    "rng_state",
    "set_rng_state",
    "write_checkpoint",
]

CKPT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json")


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
        hint = (
            f"The previous good checkpoint is {good}: resume from it with --resume-from {good} (or delete {latest})."
            if good
            else "No earlier good checkpoint exists."
        )
        raise CheckpointError(f"refusing to resume from the latest checkpoint: {e}. {hint}") from e


def rng_state() -> dict:
    """This process's RNG states as tensors, ints and lists only (loadable with ``weights_only=True``)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    """Restores ``rng_state`` (or the numpy-array form of checkpoints written before it)."""
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

    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):  # RNG states of checkpoints before 0.1.1
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "unsupported global" in ln.lower()), lines[-1] if lines else type(e).__name__)
        raise CheckpointError(
            f"{path}: refused: it holds more than tensors and plain values, and loading it could run code ({reason[:200]})"
        ) from None


_NUMPY_CORE = getattr(np, "_core", None) or np.core
_NUMPY_ARRAY_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def write_checkpoint(
    out: str,
    step: int,
    *,
    model_state: dict,
    optimizer_state: dict,
    scheduler_state: dict,
    rng_states: list,
    trainer_state: dict,
    keep: int,
) -> str:
    """Writes ``out/checkpoints/step-<step>`` atomically and keeps only the newest ``keep`` checkpoints."""

    root = os.path.join(out, "checkpoints")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"step-{step:07d}")
    tmp = os.path.join(root, f".tmp-step-{step:07d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(
        {k: v.contiguous() for k, v in model_state.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"}
    )
    torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
    torch.save(scheduler_state, os.path.join(tmp, "scheduler.pt"))
    torch.save(rng_states, os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f, indent=2)
    _write_manifest(tmp, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    _fsync_dir(root)
    for old in list_checkpoints(out)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _write_manifest(path: str, step: int) -> None:
    files = {}
    for name in CKPT_FILES:
        fp = os.path.join(path, name)
        with open(fp, "rb") as fh:
            os.fsync(fh.fileno())
        files[name] = dict(bytes=os.path.getsize(fp), sha256=_sha256(fp))
    records.atomic_write_json(os.path.join(path, "manifest.json"), dict(format=1, step=step, files=files), indent=2)
    _fsync_dir(path)
