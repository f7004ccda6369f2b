"""The learning-rate schedule of ``efla train`` (linear warm-up, cosine decay, optionally extended at
``min_lr``) and the rule that a resumed run keeps its checkpoint's schedule and optimizer settings."""

from __future__ import annotations

import json
import math
import os

from efla.errors import UsageError

from efla.training.config import Sizes, TrainConfig

__all__ = ["lr_at", "scheduled_lr", "schedule_of", "hyperparameters", "resumed_schedule"]


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
    ``min_lr``): ``lr_at`` over the planned steps, then ``min_lr`` for any steps past them (a run
    extended with ``extend_at_min_lr``)."""
    if step >= schedule["planned_steps"]:
        return schedule["min_lr"]
    return lr_at(step, schedule["planned_steps"], schedule["warmup"], schedule["lr"], schedule["min_lr"])


_OPTION_OF = {
    "planned_steps": "--max-steps",
    "warmup": "--warmup-steps",
    "lr": "--lr",
    "min_lr": "--min-lr",
    "weight_decay": "--weight-decay",
    "betas": "betas",
    "eps": "eps",
    "grad_clip": "--grad-clip",
}


def schedule_of(cfg: TrainConfig, r: Sizes) -> dict:
    return dict(planned_steps=r.max_steps, warmup=r.warmup, lr=cfg.lr, min_lr=cfg.min_lr)


def hyperparameters(cfg: TrainConfig) -> dict:
    return dict(weight_decay=cfg.weight_decay, betas=list(cfg.betas), eps=cfg.eps, grad_clip=cfg.grad_clip)


def _saved_settings(state: dict, out: str) -> dict:
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


def resumed_schedule(cfg: TrainConfig, r: Sizes, ckpt: str, state: dict) -> dict:
    """The schedule a resumed run continues: the checkpoint's own. A larger ``max_steps`` with
    ``extend_at_min_lr`` keeps it to its planned end and trains the extra steps at ``min_lr``.

    Raises:
        UsageError: any other change of the schedule or optimizer settings (named with both values).
    """
    saved = _saved_settings(state, cfg.out)
    now = dict(schedule_of(cfg, r), **hyperparameters(cfg))
    if cfg.warmup_steps is None:  # derived from the length: the saved run's own
        now["warmup"] = saved.get("warmup", now["warmup"])
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    extended = "planned_steps" in changed and cfg.extend_at_min_lr and now["planned_steps"] > saved["planned_steps"]
    if extended:
        changed.remove("planned_steps")
    if changed:
        what = ", ".join(f"{_OPTION_OF[k]} {saved[k]} -> {now[k]}" for k in changed)
        hint = (
            "; to train longer, pass --extend-at-min-lr (the saved schedule runs to its end, the extra steps train at --min-lr)"
            if changed == ["planned_steps"] and now["planned_steps"] > saved["planned_steps"]
            else ""
        )
        raise UsageError(f"{ckpt} was trained with other settings ({what}); a resumed run keeps them{hint} (--resume)")
    return {k: saved.get(k, now[k]) for k in ("planned_steps", "warmup", "lr", "min_lr")}
