"""Orchestration of the robustness experiment and the lr sweep: the runs (their files and tables are in
:mod:`efla_lab.robustness.report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from efla.variants import label

from efla_lab import harness
from efla_lab.robustness.model import (
    FULL_LEVELS,
    PAPER_LR,
    QUICK_LEVELS,
    TrainConfig,
    evaluate,
    evaluate_perturbations,
    train_classifier,
)

SWEEP_LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
QUICK_SWEEP_LRS = [1e-3, 1e-2]
QUICK_TRAIN_LIMIT, QUICK_TEST_LIMIT = 6000, 2000


@dataclass
class RobustnessOptions:
    rules: list = field(default_factory=lambda: ["exact", "euler"])
    lr: float = 1e-3
    paper_lr: bool = False  # also run the authors' per-rule learning rates
    seeds: list = field(default_factory=lambda: [0])
    epochs: int = 1
    batch_size: int = 128
    width: int = 64
    num_heads: int = 1
    authors_model: bool = False
    quick: bool = False
    train_limit: int | None = None
    test_limit: int | None = None
    device: str = "cpu"
    eval_seed: int = 1234

    @classmethod
    def for_data(
        cls,
        data_name: str,
        *,
        quick: bool,
        epochs: int | None,
        seeds: list | None,
        train_limit: int | None,
        test_limit: int | None,
        **settings,
    ) -> RobustnessOptions:
        """The options of a run on ``data_name``: one epoch on MNIST as in the paper, 40 on the small
        embedded digits; ``quick`` trains and tests on a subset."""
        if quick:
            train_limit = train_limit or QUICK_TRAIN_LIMIT
            test_limit = test_limit or QUICK_TEST_LIMIT
        return cls(
            quick=quick,
            epochs=epochs if epochs is not None else (1 if data_name == "mnist" else 40),
            seeds=seeds if seeds is not None else [0],
            train_limit=train_limit,
            test_limit=test_limit,
            **settings,
        )


def sweep_lrs(lrs: list | None, quick: bool) -> list:
    """The learning rates to sweep: those given, else a short list when quick, else the full one."""
    return lrs or (QUICK_SWEEP_LRS if quick else SWEEP_LRS)


def versions() -> dict:
    return harness.versions("transformers")


def run_robustness(data, opts: RobustnessOptions, progress_factory=None) -> dict:
    """Train every (setting, rule, seed) and evaluate it under every perturbation."""
    levels = QUICK_LEVELS if opts.quick else FULL_LEVELS
    settings = [("same-lr", {r: opts.lr for r in opts.rules})]
    if opts.paper_lr:
        settings.append(("paper-lr", {r: PAPER_LR[r] for r in opts.rules}))
    n_train = min(len(data.x_train), opts.train_limit or len(data.x_train))
    steps_per_run = opts.epochs * math.ceil(n_train / opts.batch_size)
    n_evals = sum(len(v) for v in levels.values())
    runs = []
    for setting, lrs in settings:
        for rule in opts.rules:
            for seed in opts.seeds:
                cfg = TrainConfig(
                    rule=rule,
                    lr=lrs[rule],
                    epochs=opts.epochs,
                    batch_size=opts.batch_size,
                    seed=seed,
                    width=opts.width,
                    num_heads=opts.num_heads,
                    authors_model=opts.authors_model,
                    train_limit=opts.train_limit,
                    device=opts.device,
                )
                desc = f"{setting} {label(rule)} lr={lrs[rule]:g} seed={seed}"
                bar = progress_factory(total=steps_per_run, desc="train " + desc) if progress_factory else None
                model, tr = train_classifier(data, cfg, progress=bar.update if bar else None)
                if bar:
                    bar.close()
                bar = progress_factory(total=n_evals, desc="eval  " + desc) if progress_factory else None
                ev = evaluate_perturbations(
                    model,
                    data,
                    levels,
                    eval_seed=opts.eval_seed,
                    test_limit=opts.test_limit,
                    device=opts.device,
                    progress=bar.update if bar else None,
                )
                if bar:
                    bar.close()
                runs.append(
                    dict(
                        setting=setting,
                        rule=rule,
                        seed=seed,
                        lr=lrs[rule],
                        diverged=tr.diverged,
                        train_seconds=tr.seconds,
                        final_train_loss=tr.final_train_loss,
                        losses=tr.losses,
                        eval=ev,
                    )
                )
    return dict(
        dataset=dict(
            name=data.name,
            source=data.source,
            seq_len=data.seq_len,
            n_train=n_train,
            n_test=min(len(data.x_test), opts.test_limit or len(data.x_test)),
        ),
        options=opts.__dict__,
        levels=levels,
        runs=runs,
        versions=versions(),
    )


def run_lr_sweep(data, opts: RobustnessOptions, lrs=None, progress_factory=None) -> dict:
    lrs = lrs or SWEEP_LRS
    n_train = min(len(data.x_train), opts.train_limit or len(data.x_train))
    steps = opts.epochs * math.ceil(n_train / opts.batch_size)
    rows = []
    for rule in opts.rules:
        for lr in lrs:
            for seed in opts.seeds:
                cfg = TrainConfig(
                    rule=rule,
                    lr=lr,
                    epochs=opts.epochs,
                    batch_size=opts.batch_size,
                    seed=seed,
                    width=opts.width,
                    num_heads=opts.num_heads,
                    authors_model=opts.authors_model,
                    train_limit=opts.train_limit,
                    device=opts.device,
                )
                bar = (
                    progress_factory(total=steps, desc=f"lr-sweep {label(rule)} lr={lr:g} seed={seed}")
                    if progress_factory
                    else None
                )
                model, tr = train_classifier(data, cfg, progress=bar.update if bar else None)
                if bar:
                    bar.close()
                x, y = data.x_test, data.y_test
                if opts.test_limit:
                    x, y = x[: opts.test_limit], y[: opts.test_limit]
                acc = evaluate(model, x, y, device=opts.device)
                rows.append(
                    dict(
                        rule=rule,
                        lr=lr,
                        seed=seed,
                        final_train_loss=tr.final_train_loss,
                        test_accuracy=acc,
                        diverged=tr.diverged,
                        losses=tr.losses,
                    )
                )
    return dict(
        dataset=dict(name=data.name, source=data.source, n_train=n_train),
        options=opts.__dict__,
        lrs=lrs,
        rows=rows,
        versions=versions(),
    )
