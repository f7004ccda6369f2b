"""Where an ``efla train`` run starts: its output directory checked and locked, the checkpoint to
resume from chosen (or the directory cleared for a fresh start), a resume that would change the run
refused; and a failed run's cleanup, which leaves what a resume needs and nothing else."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings

from efla.errors import RunWarning, UsageError

from efla.training.checkpoint import CheckpointError, find_resume_checkpoint, list_checkpoints, verify_checkpoint
from efla.training.run_dir import LOCK_NAME, check_out_dir, claim_run_dir
from efla.training.config import TrainConfig, check_resume_unchanged, stored_train_args
from efla.training.process_group import Dist

__all__ = ["claim_and_choose_start", "clean_after_failure", "refuse_a_changed_resume"]


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
            raise UsageError(
                f"{cfg.out} has no checkpoint to resume from; pass --resume-or-start to start a new "
                "run when there is none (--resume)"
            )
        return ckpt
    if list_checkpoints(cfg.out) and not cfg.overwrite:
        raise UsageError(
            f"{cfg.out} already has checkpoints: pass --resume to continue that run, --overwrite to "
            "start again, or another --out (--out)"
        )
    return None


def _clear_for_fresh_start(cfg: TrainConfig) -> None:
    if cfg.overwrite:
        shutil.rmtree(os.path.join(cfg.out, "checkpoints"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(cfg.out, "log.jsonl"))


def claim_and_choose_start(cfg: TrainConfig, dist: Dist):
    """Rank 0 checks ``out``, locks it and picks the checkpoint; every rank gets the outcome.

    Returns ``(lock or None, checkpoint or None, the names in out before or None)``; on an error the lock
    is released and a lock file or directory created here is removed again, so a refused run leaves
    nothing behind."""
    lock, ckpt, error, before = None, None, None, None
    if dist.main:
        before = sorted(os.listdir(cfg.out)) if os.path.isdir(cfg.out) else None
        try:
            check_out_dir(cfg.out, cfg.overwrite)
            lock = claim_run_dir(cfg.out)
            if lock.stale_holder:
                warnings.warn(
                    f"took over the lock of a run that is no longer running (pid {lock.stale_holder.get('pid')}) in {cfg.out}",
                    RunWarning,
                    stacklevel=2,
                )
            ckpt = _choose_start(cfg)
            if ckpt is None:
                _clear_for_fresh_start(cfg)
        except (UsageError, CheckpointError) as e:
            error = e
            _undo_claim(cfg.out, lock, before)
            lock = None
    error, ckpt = dist.broadcast((error, ckpt))
    if error is not None:
        raise error
    return lock, ckpt, before


def _undo_claim(out: str, lock, before: list[str] | None) -> None:
    """Releases ``lock`` and removes its file (and ``out``) where this run created them."""
    if lock is None or lock.fd < 0:
        return
    lock.release()
    with contextlib.suppress(OSError):
        if before is None or LOCK_NAME not in before:
            os.remove(os.path.join(out, LOCK_NAME))
        if before is None:
            os.rmdir(out)


def _run_dir_of(cfg: TrainConfig) -> str:
    """The run whose settings a resume continues: ``out``, or the run holding ``resume_from``."""
    if cfg.resume_from:
        return os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume_from)))
    return cfg.out


def refuse_a_changed_resume(cfg: TrainConfig) -> None:
    """A resume (of a run with a checkpoint) refuses settings that would change the run; read-only."""
    if not (cfg.resume_from or ((cfg.resume or cfg.resume_or_start) and list_checkpoints(cfg.out))):
        return
    stored = stored_train_args(_run_dir_of(cfg))
    if stored is not None:
        check_resume_unchanged(stored, dataclasses.asdict(cfg))


def clean_after_failure(out: str, lock, before: list[str] | None) -> None:
    """A run that fails leaves what a resume needs and nothing else: with no checkpoint in ``out`` that is
    nothing, so ``out`` is as it was before (gone if this run made it); else unfinished checkpoint writes
    are removed."""
    if list_checkpoints(out):
        for name in os.listdir(os.path.join(out, "checkpoints")):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(out, "checkpoints", name), ignore_errors=True)
        return
    for name in set(os.listdir(out)) - set(before or []) - {LOCK_NAME}:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    _undo_claim(out, lock, before)
