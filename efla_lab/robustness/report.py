"""The robustness and lr-sweep results as files: JSON, CSV, plots, and the tables printed and written
to the Markdown summaries."""

from __future__ import annotations

import json
import os
import statistics

from efla.variants import label
from efla_lab.style import colour

from efla_lab import harness
from efla_lab.seeds import sample_std

KIND_LABEL = {"scale": "intensity scale (x)", "noise": "Gaussian noise std", "dropout": "pixel dropout p"}


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
                entry[kind] = dict(
                    levels=results["levels"][kind],
                    mean=[statistics.mean(c) for c in cols],
                    min=[min(c) for c in cols],
                    max=[max(c) for c in cols],
                    area=statistics.mean(statistics.mean(a) for a in accs),
                    area_std=sample_std([statistics.mean(a) for a in accs]),
                )
            out[setting][rule] = entry
    return out


def write_robustness_outputs(results: dict, out_dir: str, command: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    agg = aggregate(results)
    results = dict(results, aggregate=agg, command=command)
    p = os.path.join(out_dir, "results.json")
    harness.atomic_write_json(p, results)
    written.append(p)
    for setting in agg:
        p = os.path.join(out_dir, f"robustness_{setting}.csv")
        harness.atomic_write_csv(
            p, ["setting", "rule", "seed", "lr", "perturbation", "level", "accuracy"], _robustness_csv_rows(results, setting)
        )
        written.append(p)
    written += plot_robustness(results, agg, out_dir)
    p = os.path.join(out_dir, "summary.md")
    files = harness.files_section([os.path.basename(w) for w in written])
    harness.atomic_write(p, robustness_summary(results, agg, command) + "\n".join(files) + "\n")
    written.append(p)
    return written


def _robustness_csv_rows(results: dict, setting: str):
    for run in results["runs"]:
        if run["setting"] != setting:
            continue
        yield [setting, run["rule"], run["seed"], run["lr"], "clean", "", run["eval"]["clean"]]
        for kind in results["levels"]:
            for lv, acc in zip(run["eval"][kind]["levels"], run["eval"][kind]["accuracy"]):
                yield [setting, run["rule"], run["seed"], run["lr"], kind, lv, acc]


def _title(results) -> str:
    o = results["options"]
    seeds = len(o["seeds"])
    return f"{results['dataset']['name']} ({results['dataset']['n_train']} train), {o['epochs']} epoch(s), {seeds} seed(s)"


def plot_robustness(results: dict, agg: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for setting, by_rule in agg.items():
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, kind in zip(axes, results["levels"]):
            for rule, e in by_rule.items():
                lv = e[kind]["levels"]
                ax.plot(lv, e[kind]["mean"], "o-", color=colour(rule), label=f"{label(rule)} (lr {e['lr']:g})")
                ax.fill_between(lv, e[kind]["min"], e[kind]["max"], color=colour(rule), alpha=0.2)
            ax.set_xlabel(KIND_LABEL[kind])
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.set_title(f"accuracy vs {KIND_LABEL[kind]}")
            ax.legend()
        spread = "; mean over seeds, band = min..max" if any(_several_seeds(e) for e in by_rule.values()) else ""
        fig.suptitle(f"Robustness ({setting}): {_title(results)}{spread}")
        fig.tight_layout()
        p = os.path.join(out_dir, f"robustness_{setting}.png")
        harness.atomic_save_figure(fig, p)
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
        ax.plot(
            range(1, n + 1), smooth, styles.get(setting, "-"), color=colour(rule), label=f"{label(rule)} lr {lr:g} ({setting})"
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (moving average)")
    ax.set_title(f"Training loss: {_title(results)}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out_dir, "training_loss.png")
    harness.atomic_save_figure(fig, p)
    written.append(p)
    return written


def robustness_tables(results: dict, agg: dict) -> dict[str, harness.Table]:
    """Per setting: accuracy averaged over each perturbation's levels, by rule (console and summary.md)."""
    tables = {}
    for setting, by_rule in agg.items():
        rules = list(by_rule)
        compared = "exact" in by_rule and "euler" in by_rule
        table = harness.Table(
            title=f"{results['dataset']['name']}: accuracy averaged over perturbation levels ({setting})",
            columns=["perturbation", "levels", *(f"{label(r)} (lr {by_rule[r]['lr']:g})" for r in rules), "EFLA − DeltaNet"],
            right=set(range(2, len(rules) + 3)),
        )
        diff = f"{by_rule['exact']['clean']['mean'] - by_rule['euler']['clean']['mean']:+.4f}" if compared else ""
        table.add_row("clean", "–", *(f"{by_rule[r]['clean']['mean']:.4f}" for r in rules), diff)
        for kind in results["levels"]:
            lv = by_rule[rules[0]][kind]["levels"]
            diff = f"{by_rule['exact'][kind]['area'] - by_rule['euler'][kind]['area']:+.4f}" if compared else ""
            table.add_row(kind, f"{lv[0]:g}..{lv[-1]:g} ({len(lv)})", *(_area_cell(by_rule[r], kind) for r in rules), diff)
        tables[setting] = table
    return tables


def _several_seeds(entry: dict) -> bool:
    return len(set(entry["seeds"])) > 1


def _area_cell(entry: dict, kind: str) -> str:
    """Accuracy averaged over a perturbation's levels; its spread only where the runs differ in seed."""
    area = f"{entry[kind]['area']:.4f}"
    return f"{area} ± {entry[kind]['area_std']:.4f}" if _several_seeds(entry) else area


def _cell_note(agg: dict) -> str:
    entries = [entry for by_rule in agg.values() for entry in by_rule.values()]
    if any(_several_seeds(e) for e in entries):
        return (
            "Each cell: accuracy averaged over the perturbation levels (mean over seeds ± sample standard "
            "deviation over seeds where a cell has several seeds)."
        )
    seeds = sorted({s for e in entries for s in e["seeds"]})
    return (
        f"Each cell: accuracy averaged over the perturbation levels, from one seed (seed "
        f"{', '.join(map(str, seeds))}; no spread over seeds)."
    )


def robustness_summary(results: dict, agg: dict, command: str) -> str:
    lines = [
        f"# Robustness: {_title(results)}",
        "",
        f"Command as run: `{command}`",
        "",
        f"Data: {results['dataset']['source']}; versions: {json.dumps(results['versions'])}",
        "",
        f"{_cell_note(agg)} Higher means the model degrades more slowly.",
        "",
    ]
    tables = robustness_tables(results, agg)
    for setting, by_rule in agg.items():
        lines += [f"## {setting}", "", *tables[setting].markdown()]
        lines.append("")
        if "exact" in by_rule and "euler" in by_rule:
            for kind in results["levels"]:
                a, b = by_rule["exact"][kind]["area"], by_rule["euler"][kind]["area"]
                verdict = "EFLA degrades more slowly" if a > b else "EFLA does NOT degrade more slowly"
                worst_e, worst_d = by_rule["exact"][kind]["mean"][-1], by_rule["euler"][kind]["mean"][-1]
                lines.append(
                    f"- {kind}: {verdict} (mean accuracy over levels {a:.4f} vs {b:.4f}; at the strongest "
                    f"level {worst_e:.4f} vs {worst_d:.4f})."
                )
            lines.append("")
    return "\n".join(lines)


def _lr_sweep_means(results: dict) -> dict:
    """``{rule: {lr: (mean final train loss, mean test accuracy, loss std, accuracy std, seeds)}}``
    over the seeds of each cell (sample standard deviations, 0 for one seed)."""
    by_rule: dict = {}
    for r in results["rows"]:
        by_rule.setdefault(r["rule"], {}).setdefault(r["lr"], []).append(r)

    def stats(rows):
        losses = [x["final_train_loss"] for x in rows]
        accs = [x["test_accuracy"] for x in rows]
        seeds = len({x["seed"] for x in rows})
        return statistics.mean(losses), statistics.mean(accs), sample_std(losses), sample_std(accs), seeds

    return {rule: {lr: stats(rows) for lr, rows in sorted(by_lr.items())} for rule, by_lr in by_rule.items()}


def _sweep_cell(loss: float, acc: float, loss_std: float, acc_std: float, seeds: int) -> str:
    """One table cell; a spread only where the cell has two or more seeds."""
    if seeds < 2:
        return f"loss {loss:.3f} / acc {acc:.4f}"
    return f"loss {loss:.3f} ± {loss_std:.3f} / acc {acc:.4f} ± {acc_std:.4f}"


def lr_sweep_table(results: dict) -> harness.Table:
    """Final train loss / test accuracy by rule and learning rate, mean ± sample std over seeds
    (console and lr_sweep.md)."""
    seeds = len({r["seed"] for r in results["rows"]})
    table = harness.Table(
        title=f"{results['dataset']['name']}: learning-rate sweep (final train loss / test accuracy"
        + (f", mean ± sample std over {seeds} seeds)" if seeds > 1 else ")"),
        columns=["rule", *(f"lr {lr:g}" for lr in results["lrs"])],
        right=set(range(1, len(results["lrs"]) + 1)),
    )
    for rule, by_lr in _lr_sweep_means(results).items():
        table.add_row(label(rule), *(_sweep_cell(*by_lr[lr]) if lr in by_lr else "–" for lr in results["lrs"]))
    return table


def plot_lr_sweep(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for rule, by_lr in _lr_sweep_means(results).items():
        lrs = list(by_lr)
        for ax, mean, spread in ((axes[0], 0, 2), (axes[1], 1, 3)):
            ax.errorbar(
                lrs,
                [by_lr[lr][mean] for lr in lrs],
                yerr=[by_lr[lr][spread] for lr in lrs],
                fmt="o-",
                capsize=3,
                color=colour(rule),
                label=label(rule),
            )
    for ax, lab in zip(axes, ["final training loss (last 10% of steps)", "test accuracy"]):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend()
    o = results["options"]
    fig.suptitle(
        f"Learning-rate sweep: {results['dataset']['name']} ({results['dataset']['n_train']} train), "
        f"{o['epochs']} epoch(s), {len(o['seeds'])} seed(s)"
    )
    fig.tight_layout()
    harness.atomic_save_figure(fig, path)


def write_lr_sweep_outputs(results: dict, out_dir: str, command: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    results = dict(results, command=command)
    files = {name: os.path.join(out_dir, name) for name in ("lr_sweep.json", "lr_sweep.csv", "lr_sweep.png", "lr_sweep.md")}
    harness.atomic_write_json(files["lr_sweep.json"], results)
    harness.atomic_write_csv(
        files["lr_sweep.csv"],
        ["rule", "lr", "seed", "final_train_loss", "test_accuracy", "diverged"],
        ([r["rule"], r["lr"], r["seed"], r["final_train_loss"], r["test_accuracy"], r["diverged"]] for r in results["rows"]),
    )
    plot_lr_sweep(results, files["lr_sweep.png"])
    lines = [
        f"# Learning-rate sweep: {results['dataset']['name']}",
        "",
        f"Command as run: `{command}`",
        "",
        *lr_sweep_table(results).markdown(),
        *harness.files_section(["lr_sweep.json", "lr_sweep.csv", "lr_sweep.png"]),
    ]
    harness.atomic_write(files["lr_sweep.md"], "\n".join(lines) + "\n")
    return list(files.values())
