"""MAD scores ("max over the grid, mean over settings") and the output files: ``results.json``,
``runs.csv``, ``summary.md`` (a table per task: EFLA, DeltaNet, difference, the paper's numbers)
and ``mad_scores.png`` (grouped bars, like the paper's Fig. 3)."""

from __future__ import annotations

import json
import os
import statistics

from efla_lab.data.mad_tasks import TASK_LABEL, TASKS
from efla.variants import VARIANTS, Variant, label
from efla_lab.style import colour

from efla_lab import harness
from efla_lab.mad.model import RULES

# EFLA paper (arXiv 2512.12602), MAD table, percent
PAPER = {
    "compression": {"euler": 42.7, "exact": 43.8},
    "fuzzy-in-context-recall": {"euler": 22.2, "exact": 22.6},
    "in-context-recall": {"euler": 99.9, "exact": 100.0},
    "memorization": {"euler": 29.9, "exact": 32.5},
    "noisy-in-context-recall": {"euler": 99.9, "exact": 100.0},
    "selective-copying": {"euler": 99.6, "exact": 99.8},
}
PAPER_AVERAGE = {"euler": 65.7, "exact": 66.4}


def aggregate(runs: list[dict]) -> dict:
    """``{rule: {task: {"score", "n_settings", "settings": {id: {"acc", "lr", "wd"}}}, "average": x}}``.

    Per setting the maximum test accuracy over the (lr, wd) runs; per task the mean of these
    maxima over its settings; the average is the plain mean over the tasks present."""
    by: dict = {}
    for r in runs:
        by.setdefault(r["rule"], {}).setdefault(r["task"], {}).setdefault(r["setting"], []).append(r)
    out: dict = {}
    for rule, tasks in by.items():
        out[rule] = {}
        for task, settings in tasks.items():
            per = {}
            for sid, rs in settings.items():
                best = max(rs, key=lambda r: r["test_acc"])
                per[sid] = {
                    "acc": best["test_acc"],
                    "lr": best["lr"],
                    "wd": best["weight_decay"],
                    "n_runs": len(rs),
                    "truncated": any(r["truncated"] for r in rs),
                }
            out[rule][task] = {"score": statistics.mean(v["acc"] for v in per.values()), "n_settings": len(per), "settings": per}
        scores = [v["score"] for t, v in out[rule].items()]
        out[rule]["average"] = statistics.mean(scores) if scores else float("nan")
    return out


def average_label(tasks: list[str]) -> str:
    """The name of the average row: the paper's six-task average only when all six tasks are in it."""
    if len(tasks) == len(TASKS):
        return "Average (6 tasks)"
    return f"Average of {len(tasks)} of 6 tasks ({', '.join(TASK_LABEL[t] for t in tasks)}; not a six-task average)"


def paper_average(tasks: list[str]) -> dict:
    """The paper's average over the same ``tasks`` as ours (its published six-task average for all six)."""
    if len(tasks) == len(TASKS):
        return PAPER_AVERAGE
    return {rule: statistics.mean(PAPER[t][rule] for t in tasks) for rule in ("euler", "exact")}


def _pairs(rules) -> list[tuple[str, str]]:
    pairs = [(v.key, v.euler_counterpart.key) for v in VARIANTS if v.exact]
    return [(a, b) for a, b in pairs if a in rules and b in rules]


def _tasks_in(agg: dict) -> list[str]:
    present = {t for rule in agg.values() for t in rule if t != "average"}
    return [t for t in TASKS if t in present]


def _signed(diff: float) -> str:
    colour_name = "green" if diff > 0 else "red" if diff < 0 else "white"
    return f"[{colour_name}]{diff:+.1f}[/]"


def scores_table(agg: dict, preset: str) -> harness.Table:
    """Per task and on average: each rule's score, the EFLA-vs-DeltaNet differences and the paper's
    numbers, ×100 (the console and summary.md)."""
    rules = [r for r in RULES if r in agg]
    tasks = _tasks_in(agg)
    pairs = _pairs(rules)
    columns = (
        ["task"]
        + [label(r) for r in rules]
        + [f"{label(a)} − {label(b)}" for a, b in pairs]
        + ["paper DeltaNet", "paper EFLA", "paper EFLA − DeltaNet"]
    )
    table = harness.Table(
        title=f"MAD accuracy ×100 ({preset} preset; paper = full 66-setting protocol)",
        columns=columns,
        right=set(range(1, len(columns))),
    )
    for t in tasks:
        vals = [f"{100 * agg[r][t]['score']:.1f}" if t in agg[r] else "–" for r in rules]
        diffs = [
            _signed(100 * (agg[a][t]["score"] - agg[b][t]["score"])) if t in agg[a] and t in agg[b] else "–" for a, b in pairs
        ]
        p = PAPER[t]
        table.add_row(TASK_LABEL[t], *vals, *diffs, f"{p['euler']:.1f}", f"{p['exact']:.1f}", f"{p['exact'] - p['euler']:+.1f}")
    vals = [f"{100 * agg[r]['average']:.1f}" for r in rules]
    diffs = [_signed(100 * (agg[a]["average"] - agg[b]["average"])) for a, b in pairs]
    paper = paper_average(tasks)
    table.add_row(
        average_label(tasks),
        *vals,
        *diffs,
        f"{paper['euler']:.1f}",
        f"{paper['exact']:.1f}",
        f"{paper['exact'] - paper['euler']:+.1f}",
        bold=True,
    )
    return table


def summary_markdown(results: dict, agg: dict, command: str) -> str:
    rules = [r for r in RULES if r in agg]
    tasks = _tasks_in(agg)
    pairs = _pairs(rules)
    opts = results["options"]
    lines = [
        f"# MAD synthetic benchmark ({opts['preset']} preset)",
        "",
        f"Command as run: `{command}`",
        "",
        f"Preset: {results['preset']['description']}. Heads: {opts['num_heads']}; precision {opts['precision']}; "
        f"seed {opts['seed']}; device {opts['device']}; versions: {json.dumps(results['versions'])}.",
        "",
        "Overrides of the preset: "
        + (
            ", ".join(
                f"{k}={opts[k]}"
                for k in ("lrs", "wds", "epochs", "max_steps", "time_limit", "width", "batch_size")
                if opts.get(k) is not None
            )
            or "none"
        )
        + ".",
        "",
        "Accuracy is MAD's class-balanced (macro) test accuracy, ×100, at the epoch of lowest test perplexity; "
        "per setting the maximum over the lr × wd runs, per task the mean over its settings. "
        "Paper: EFLA paper (arXiv 2512.12602), all 66 settings with the full grid.",
        "",
    ]
    if results.get("missing"):
        lines += [
            f"**{len(results['missing'])} planned runs are missing** (not trained yet); the scores below use "
            "only the stored runs.",
            "",
        ]
    n_trunc = sum(1 for r in results["runs"] if r["truncated"])
    if n_trunc:
        lines += [f"**{n_trunc} runs were cut by the time limit** before their epoch budget.", ""]
    lines += ["## Scores", "", *scores_table(agg, opts["preset"]).markdown(), ""]
    for a, b in pairs:
        wins = [t for t in tasks if t in agg[a] and t in agg[b] and agg[a][t]["score"] > agg[b][t]["score"]]
        losses = [t for t in tasks if t in agg[a] and t in agg[b] and agg[a][t]["score"] < agg[b][t]["score"]]
        ties = [t for t in tasks if t in agg[a] and t in agg[b] and agg[a][t]["score"] == agg[b][t]["score"]]

        def fmt(ts, a=a, b=b):
            return ", ".join(f"{TASK_LABEL[t]} ({100 * (agg[a][t]['score'] - agg[b][t]['score']):+.1f})" for t in ts) or "none"

        lines += [
            f"- {label(a)} above {label(b)}: {fmt(wins)}.",
            f"- {label(a)} below {label(b)}: {fmt(losses)}.",
            f"- equal: {', '.join(TASK_LABEL[t] for t in ties) or 'none'}.",
            "",
        ]
    # one table per task
    for t in tasks:
        sids = []
        for r in rules:
            for sid in agg[r].get(t, {}).get("settings", {}):
                if sid not in sids:
                    sids.append(sid)
        head = ["setting"] + [label(r) + " (lr, wd)" for r in rules] + [f"{label(a)} − {label(b)}" for a, b in pairs]
        lines += [f"## {TASK_LABEL[t]} (`{t}`)", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for sid in sids:
            cells = []
            for r in rules:
                s = agg[r].get(t, {}).get("settings", {}).get(sid)
                cells.append(
                    "–" if s is None else f"{100 * s['acc']:.1f} ({s['lr']:g}, {s['wd']:g})" + (" ✂" if s["truncated"] else "")
                )
            for a, b in pairs:
                sa = agg[a].get(t, {}).get("settings", {}).get(sid)
                sb = agg[b].get(t, {}).get("settings", {}).get(sid)
                cells.append("–" if sa is None or sb is None else f"{100 * (sa['acc'] - sb['acc']):+.1f}")
            lines.append("| " + " | ".join([sid] + cells) + " |")
        cells = [f"**{100 * agg[r][t]['score']:.1f}**" if t in agg[r] else "–" for r in rules]
        cells += [
            f"**{100 * (agg[a][t]['score'] - agg[b][t]['score']):+.1f}**" if t in agg[a] and t in agg[b] else "–"
            for a, b in pairs
        ]
        lines.append("| " + " | ".join([f"task score ({len(sids)} settings)"] + cells) + " |")
        p = PAPER[t]
        paper_cells = [f"{p['exact']:.1f}" if r == "exact" else f"{p['euler']:.1f}" if r == "euler" else "–" for r in rules] + [
            f"{p['exact'] - p['euler']:+.1f}" if (a, b) == ("exact", "euler") else "–" for a, b in pairs
        ]
        lines += ["| " + " | ".join(["paper (66-setting protocol)"] + paper_cells) + " |", ""]
    lines += [
        "## Runs",
        "",
        "| setting | rule | lr | wd | test acc | best epoch / run / budget | steps | stopped | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['setting']} | {label(r['rule'])} | {r['lr']:g} | {r['weight_decay']:g} | "
            f"{100 * r['test_acc']:.1f} | {r['best_epoch']} / {r['epochs_run']} / {r['config']['epochs']} | "
            f"{r['steps']} | "
            f"{'yes' if r['stopped_early'] else ('cut' if r['truncated'] else 'no')} | {r['seconds']:.0f} |"
        )
    lines.append("")
    return "\n".join(lines)


def plot_scores(agg: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = [r for r in RULES if r in agg]
    tasks = _tasks_in(agg)
    labels = [TASK_LABEL[t] for t in tasks] + ["Average" if len(tasks) == len(TASKS) else f"Average of {len(tasks)} tasks"]
    series = []
    for r in ("euler", "exact"):
        if r in rules:
            series.append(
                (f"{label(r)} (paper)", [PAPER[t][r] for t in tasks] + [paper_average(tasks)[r]], colour(r), 0.35, "//")
            )
    for r in sorted(rules, key=lambda r: (Variant.parse(r).gated, Variant.parse(r).exact)):
        series.append(
            (
                f"{label(r)} (ours)",
                [100 * agg[r][t]["score"] if t in agg[r] else float("nan") for t in tasks] + [100 * agg[r]["average"]],
                colour(r),
                1.0,
                None,
            )
        )
    n = len(series)
    w = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels)), 4.8))
    for i, (lab, vals, col, alpha, hatch) in enumerate(series):
        xs = [j + (i - (n - 1) / 2) * w for j in range(len(labels))]
        bars = ax.bar(xs, vals, w, label=lab, color=col, alpha=alpha, hatch=hatch, edgecolor="black", linewidth=0.4)
        for b, v in zip(bars, vals):
            if v == v:
                ax.text(b.get_x() + b.get_width() / 2, v + 0.8, f"{v:.1f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("MAD accuracy (%)")
    ax.set_ylim(0, 130)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=len(series), loc="upper center", frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    harness.atomic_save_figure(fig, path, dpi=120)


CSV_FIELDS = [
    "task",
    "setting",
    "rule",
    "lr",
    "weight_decay",
    "seed",
    "test_acc",
    "test_ppl",
    "test_token_acc",
    "best_epoch",
    "max_test_acc",
    "epochs_run",
    "epochs_budget",
    "steps",
    "stopped_early",
    "truncated",
    "diverged",
    "final_train_loss",
    "seconds",
    "num_heads",
    "precision",
    "device",
    "num_params",
    "leakage",
    "key",
]


def csv_row(run: dict) -> list:
    row = {k: run.get(k) for k in CSV_FIELDS}
    row.update(
        seed=run["config"]["seed"],
        epochs_budget=run["config"]["epochs"],
        num_heads=run["config"]["num_heads"],
        precision=run["config"]["precision"],
    )
    return [row[k] for k in CSV_FIELDS]


def write_outputs(results: dict, out_dir: str, command: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    agg = aggregate(results["runs"])
    results = dict(results, scores=agg, command=command, paper=PAPER, paper_average=PAPER_AVERAGE)
    written = []
    p = os.path.join(out_dir, "results.json")
    harness.atomic_write(p, json.dumps(results, indent=1))
    written.append(p)
    p = os.path.join(out_dir, "runs.csv")
    harness.atomic_write_csv(p, CSV_FIELDS, (csv_row(r) for r in results["runs"]))
    written.append(p)
    p = os.path.join(out_dir, "summary.md")
    files = harness.files_section(["results.json", "runs.csv", *(["mad_scores.png"] if agg else [])])
    harness.atomic_write(p, summary_markdown(results, agg, command) + "\n".join(files) + "\n")
    written.append(p)
    if agg:
        p = os.path.join(out_dir, "mad_scores.png")
        plot_scores(agg, p, f"MAD ({results['options']['preset']} preset): ours vs the EFLA paper")
        written.append(p)
    return written
