"""Orchestration of the robustness experiment and the lr sweep: runs, files and plots."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass, field

import torch

from .robustness import (
    FULL_LEVELS,
    PAPER_LR,
    QUICK_LEVELS,
    RULE_LABEL,
    TrainConfig,
    evaluate,
    evaluate_perturbations,
    train_classifier,
)

KIND_LABEL = {"scale": "intensity scale (x)", "noise": "Gaussian noise std", "dropout": "pixel dropout p"}
SWEEP_LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]


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
    quick: bool = False
    train_limit: int | None = None
    test_limit: int | None = None
    device: str = "cpu"
    eval_seed: int = 1234


def versions() -> dict:
    import transformers  # noqa: PLC0415

    import efla  # noqa: PLC0415

    return {
        "efla": efla.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
                cfg = TrainConfig(rule=rule, lr=lrs[rule], epochs=opts.epochs, batch_size=opts.batch_size, seed=seed,
                                  width=opts.width, num_heads=opts.num_heads, train_limit=opts.train_limit,
                                  device=opts.device)
                desc = f"{setting} {RULE_LABEL[rule]} lr={lrs[rule]:g} seed={seed}"
                bar = progress_factory(total=steps_per_run, desc="train " + desc) if progress_factory else None
                model, tr = train_classifier(data, cfg, progress=bar.update if bar else None)
                if bar:
                    bar.close()
                bar = progress_factory(total=n_evals, desc="eval  " + desc) if progress_factory else None
                ev = evaluate_perturbations(model, data, levels, eval_seed=opts.eval_seed, test_limit=opts.test_limit,
                                            device=opts.device, progress=bar.update if bar else None)
                if bar:
                    bar.close()
                runs.append(dict(setting=setting, rule=rule, seed=seed, lr=lrs[rule], diverged=tr.diverged,
                                 train_seconds=tr.seconds, final_train_loss=tr.final_train_loss, losses=tr.losses,
                                 eval=ev))
    return dict(dataset=dict(name=data.name, source=data.source, seq_len=data.seq_len, n_train=n_train,
                             n_test=min(len(data.x_test), opts.test_limit or len(data.x_test))),
                options=opts.__dict__, levels=levels, runs=runs, versions=versions())


def run_lr_sweep(data, opts: RobustnessOptions, lrs=None, progress_factory=None) -> dict:
    lrs = lrs or SWEEP_LRS
    n_train = min(len(data.x_train), opts.train_limit or len(data.x_train))
    steps = opts.epochs * math.ceil(n_train / opts.batch_size)
    rows = []
    for rule in opts.rules:
        for lr in lrs:
            for seed in opts.seeds:
                cfg = TrainConfig(rule=rule, lr=lr, epochs=opts.epochs, batch_size=opts.batch_size, seed=seed,
                                  width=opts.width, num_heads=opts.num_heads, train_limit=opts.train_limit,
                                  device=opts.device)
                bar = progress_factory(total=steps, desc=f"lr-sweep {RULE_LABEL[rule]} lr={lr:g} seed={seed}") \
                    if progress_factory else None
                model, tr = train_classifier(data, cfg, progress=bar.update if bar else None)
                if bar:
                    bar.close()
                x, y = data.x_test, data.y_test
                if opts.test_limit:
                    x, y = x[: opts.test_limit], y[: opts.test_limit]
                acc = evaluate(model, x, y, device=opts.device)
                rows.append(dict(rule=rule, lr=lr, seed=seed, final_train_loss=tr.final_train_loss,
                                 test_accuracy=acc, diverged=tr.diverged, losses=tr.losses))
    return dict(dataset=dict(name=data.name, source=data.source, n_train=n_train), options=opts.__dict__,
                lrs=lrs, rows=rows, versions=versions())


# ----------------------------------------------------------------------------- aggregation


def aggregate(results: dict) -> dict:
    """{setting: {rule: {kind: {"levels", "mean", "min", "max"}, "clean": {...}}}}."""
    agg: dict = {}
    for run in results["runs"]:
        agg.setdefault(run["setting"], {}).setdefault(run["rule"], []).append(run)
    out: dict = {}
    for setting, by_rule in agg.items():
        out[setting] = {}
        for rule, runs in by_rule.items():
            entry = {"lr": runs[0]["lr"], "seeds": [r["seed"] for r in runs]}
            cleans = [r["eval"]["clean"] for r in runs]
            entry["clean"] = dict(mean=statistics.mean(cleans), min=min(cleans), max=max(cleans))
            for kind in results["levels"]:
                accs = [r["eval"][kind]["accuracy"] for r in runs]
                cols = list(zip(*accs))
                entry[kind] = dict(levels=results["levels"][kind], mean=[statistics.mean(c) for c in cols],
                                   min=[min(c) for c in cols], max=[max(c) for c in cols],
                                   area=statistics.mean(statistics.mean(a) for a in accs),
                                   area_std=statistics.pstdev([statistics.mean(a) for a in accs]))
            out[setting][rule] = entry
    return out


def write_robustness_outputs(results: dict, out_dir: str, command: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    agg = aggregate(results)
    results = dict(results, aggregate=agg, command=command)
    p = os.path.join(out_dir, "results.json")
    _atomic_write(p, json.dumps(results, indent=1))
    written.append(p)
    for setting in agg:
        p = os.path.join(out_dir, f"robustness_{setting}.csv")
        with open(p + ".tmp", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["setting", "rule", "seed", "lr", "perturbation", "level", "accuracy"])
            for run in results["runs"]:
                if run["setting"] != setting:
                    continue
                w.writerow([setting, run["rule"], run["seed"], run["lr"], "clean", "", run["eval"]["clean"]])
                for kind in results["levels"]:
                    for lv, acc in zip(run["eval"][kind]["levels"], run["eval"][kind]["accuracy"]):
                        w.writerow([setting, run["rule"], run["seed"], run["lr"], kind, lv, acc])
        os.replace(p + ".tmp", p)
        written.append(p)
    written += plot_robustness(results, agg, out_dir)
    p = os.path.join(out_dir, "summary.md")
    _atomic_write(p, robustness_summary(results, agg, command))
    written.append(p)
    return written


def _title(results) -> str:
    o = results["options"]
    seeds = len(o["seeds"])
    return f"{results['dataset']['name']} ({results['dataset']['n_train']} train), {o['epochs']} epoch(s), {seeds} seed(s)"


def plot_robustness(results: dict, agg: dict, out_dir: str) -> list[str]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    colors = {"exact": "tab:red", "euler": "tab:blue", "gated-exact": "tab:orange", "gated-euler": "tab:cyan"}
    for setting, by_rule in agg.items():
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, kind in zip(axes, results["levels"]):
            for rule, e in by_rule.items():
                lv = e[kind]["levels"]
                ax.plot(lv, e[kind]["mean"], "o-", color=colors[rule], label=f"{RULE_LABEL[rule]} (lr {e['lr']:g})")
                ax.fill_between(lv, e[kind]["min"], e[kind]["max"], color=colors[rule], alpha=0.2)
            ax.set_xlabel(KIND_LABEL[kind])
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.set_title(f"accuracy vs {KIND_LABEL[kind]}")
            ax.legend()
        fig.suptitle(f"Robustness ({setting}): {_title(results)}; mean over seeds, band = min..max")
        fig.tight_layout()
        p = os.path.join(out_dir, f"robustness_{setting}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    # training-loss curves
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"same-lr": "-", "paper-lr": "--"}
    by_key: dict = {}
    for run in results["runs"]:
        by_key.setdefault((run["setting"], run["rule"], run["lr"]), []).append(run["losses"])
    for (setting, rule, lr), curves in by_key.items():
        n = min(len(c) for c in curves)
        mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
        win = max(1, n // 50)
        smooth = [statistics.mean(mean[max(0, i - win + 1) : i + 1]) for i in range(n)]
        ax.plot(range(1, n + 1), smooth, styles.get(setting, "-"), color=colors[rule],
                label=f"{RULE_LABEL[rule]} lr {lr:g} ({setting})")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (moving average)")
    ax.set_title(f"Training loss: {_title(results)}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "training_loss.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def robustness_summary(results: dict, agg: dict, command: str) -> str:
    lines = [f"# Robustness: {_title(results)}", "", f"Command: `{command}`", "",
             f"Data: {results['dataset']['source']}; versions: {json.dumps(results['versions'])}", "",
             "Each cell: accuracy averaged over the perturbation levels (mean over seeds ± std over seeds). "
             "Higher means the model degrades more slowly.", ""]
    for setting, by_rule in agg.items():
        rules = list(by_rule)
        lines += [f"## {setting}", "", "| perturbation | levels | " + " | ".join(
            f"{RULE_LABEL[r]} (lr {by_rule[r]['lr']:g})" for r in rules) + " | EFLA − DeltaNet |",
            "| --- | --- | " + " | ".join("---" for _ in rules) + " | --- |"]
        clean = " | ".join(f"{by_rule[r]['clean']['mean']:.4f}" for r in rules)
        diff = ""
        if "exact" in by_rule and "euler" in by_rule:
            diff = f"{by_rule['exact']['clean']['mean'] - by_rule['euler']['clean']['mean']:+.4f}"
        lines.append(f"| clean | – | {clean} | {diff} |")
        for kind in results["levels"]:
            cells = " | ".join(f"{by_rule[r][kind]['area']:.4f} ± {by_rule[r][kind]['area_std']:.4f}" for r in rules)
            lv = by_rule[rules[0]][kind]["levels"]
            d = ""
            if "exact" in by_rule and "euler" in by_rule:
                d = f"{by_rule['exact'][kind]['area'] - by_rule['euler'][kind]['area']:+.4f}"
            lines.append(f"| {kind} | {lv[0]:g}..{lv[-1]:g} ({len(lv)}) | {cells} | {d} |")
        lines.append("")
        if "exact" in by_rule and "euler" in by_rule:
            for kind in results["levels"]:
                a, b = by_rule["exact"][kind]["area"], by_rule["euler"][kind]["area"]
                verdict = "EFLA degrades more slowly" if a > b else "EFLA does NOT degrade more slowly"
                worst_e, worst_d = by_rule["exact"][kind]["mean"][-1], by_rule["euler"][kind]["mean"][-1]
                lines.append(f"- {kind}: {verdict} (mean accuracy over levels {a:.4f} vs {b:.4f}; at the strongest "
                             f"level {worst_e:.4f} vs {worst_d:.4f}).")
            lines.append("")
    return "\n".join(lines)


def write_lr_sweep_outputs(results: dict, out_dir: str, command: str) -> list[str]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    results = dict(results, command=command)
    written = []
    p = os.path.join(out_dir, "lr_sweep.json")
    _atomic_write(p, json.dumps(results, indent=1))
    written.append(p)
    p = os.path.join(out_dir, "lr_sweep.csv")
    with open(p + ".tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rule", "lr", "seed", "final_train_loss", "test_accuracy", "diverged"])
        for r in results["rows"]:
            w.writerow([r["rule"], r["lr"], r["seed"], r["final_train_loss"], r["test_accuracy"], r["diverged"]])
    os.replace(p + ".tmp", p)
    written.append(p)
    colors = {"exact": "tab:red", "euler": "tab:blue", "gated-exact": "tab:orange", "gated-euler": "tab:cyan"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    by_rule: dict = {}
    for r in results["rows"]:
        by_rule.setdefault(r["rule"], {}).setdefault(r["lr"], []).append(r)
    table = []
    for rule, by_lr in by_rule.items():
        lrs = sorted(by_lr)
        loss = [statistics.mean(x["final_train_loss"] for x in by_lr[lr]) for lr in lrs]
        acc = [statistics.mean(x["test_accuracy"] for x in by_lr[lr]) for lr in lrs]
        axes[0].plot(lrs, loss, "o-", color=colors[rule], label=RULE_LABEL[rule])
        axes[1].plot(lrs, acc, "o-", color=colors[rule], label=RULE_LABEL[rule])
        table.append((rule, lrs, loss, acc))
    for ax, lab in zip(axes, ["final training loss (last 10% of steps)", "test accuracy"]):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend()
    o = results["options"]
    fig.suptitle(f"Learning-rate sweep: {results['dataset']['name']} ({results['dataset']['n_train']} train), "
                 f"{o['epochs']} epoch(s), {len(o['seeds'])} seed(s)")
    fig.tight_layout()
    p = os.path.join(out_dir, "lr_sweep.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    lines = [f"# Learning-rate sweep: {results['dataset']['name']}", "", f"Command: `{command}`", "",
             "| rule | " + " | ".join(f"lr {lr:g}" for lr in results["lrs"]) + " |",
             "| --- | " + " | ".join("---" for _ in results["lrs"]) + " |"]
    for rule, lrs, loss, acc in table:
        lines.append(f"| {RULE_LABEL[rule]} | " + " | ".join(f"loss {lo:.3f} / acc {a:.4f}" for lo, a in zip(loss, acc)) + " |")
    p = os.path.join(out_dir, "lr_sweep.md")
    _atomic_write(p, "\n".join(lines) + "\n")
    written.append(p)
    return written
