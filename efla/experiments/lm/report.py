"""``efla lm-report``: loss curves and a summary table of finished ``efla train`` runs, grouped by variant."""

from __future__ import annotations

import json
import math
import os
import statistics

from efla.variants import VARIANTS, colour, label

from .. import harness
from .train import read_log

__all__ = ["collect_runs", "write_lm_report"]

# the model variants in report order, as ``EFLAConfig.variant`` names them
LM_VARIANTS = tuple(v.preset_suffix.replace("-", "_") for v in VARIANTS)


def _smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def collect_runs(run_dirs: list[str], tail: int = 20) -> list[dict]:
    """Per run: variant, seed, its loss and validation curves and the summary numbers
    (``final_loss`` is the mean training loss of the last ``tail`` steps)."""
    rows = []
    for d in run_dirs:
        if not os.path.exists(os.path.join(d, "train_summary.json")):
            continue  # unfinished run
        with open(os.path.join(d, "train_summary.json")) as f:
            summ = json.load(f)
        with open(os.path.join(d, "train_args.json")) as f:
            args = json.load(f)
        log = [e for e in read_log(d) if "error" not in e]
        curve = [(e["step"], e["tokens"], e["loss"]) for e in log]
        val = [(e["step"], e["tokens"], e["val_loss"]) for e in log if "val_loss" in e]
        last = [c[2] for c in curve[-tail:]]
        rows.append(dict(run=os.path.basename(os.path.normpath(d)), dir=d, variant=summ["variant"], seed=args["seed"],
                         preset=args.get("preset"), config=args.get("config_file"), steps=summ["steps"], tokens=summ["tokens"],
                         n_params=summ["n_params"], final_loss=sum(last) / len(last) if last else None,
                         val_loss=summ["val_loss"], tokens_per_s=summ["tokens_per_s"], threads=summ.get("threads"),
                         train_seconds=summ.get("train_seconds_this_process"), resolved=args.get("resolved", {}),
                         curve=curve, val_curve=val))
    return rows


def _csv_rows(rows: list[dict]):
    for r in rows:
        val = {s: v for s, _, v in r["val_curve"]}
        for s, t, loss in r["curve"]:
            yield [r["run"], r["variant"], r["seed"], s, t, f"{loss:.6f}", f"{val[s]:.6f}" if s in val else ""]


def plot_loss_curves(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        toks = [t / 1e6 for _, t, _ in r["curve"]]
        lab = f"{label(r['variant'])} (seed {r['seed']})"
        axes[0].plot(toks, _smooth([x for _, _, x in r["curve"]], 20), color=colour(r["variant"]),
                     lw=1.0, alpha=0.8, label=lab)
        axes[1].plot([t / 1e6 for _, t, _ in r["val_curve"]], [x for _, _, x in r["val_curve"]], marker=".",
                     color=colour(r["variant"]), lw=1.0, alpha=0.8, label=lab)
    axes[0].set(xlabel="training tokens (M)", ylabel="training loss (20-step moving average)", title="training loss")
    axes[1].set(xlabel="training tokens (M)", ylabel="validation loss (held-out sequences)", title="validation loss")
    lo = min(min(x for _, _, x in r["curve"][len(r["curve"]) // 4:]) for r in rows)
    axes[0].set_ylim(lo - 0.1, lo + 2.5)
    vlo = min(min((x for _, _, x in r["val_curve"]), default=lo) for r in rows)
    axes[1].set_ylim(vlo - 0.1, vlo + 2.5)
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab.split(" (seed")[0], h)
    axes[0].legend(seen.values(), seen.keys())
    fig.suptitle(title)
    fig.tight_layout()
    harness.atomic_save_figure(fig, path, dpi=120)


def _mean_spread(xs, fmt=".4f") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:{fmt}}"
    return f"{statistics.mean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"


def variants_table(rows: list[dict]) -> harness.Table:
    """Per variant: seeds, final train and validation loss, validation perplexity, tokens/s."""
    table = harness.Table(title="Language modelling by variant",
                          columns=["model", "seeds", "final train loss (mean of last 20 steps)",
                                   "final validation loss", "validation ppl", "tokens/s per run (as run, see below)"],
                          right={2, 3, 4, 5})
    for v in (v for v in LM_VARIANTS if any(r["variant"] == v for r in rows)):
        rs = [r for r in rows if r["variant"] == v]
        vl = [r["val_loss"] for r in rs if r["val_loss"] is not None]
        tps = [r["tokens_per_s"] for r in rs if r["tokens_per_s"]]
        table.add_row(label(v), ", ".join(str(r["seed"]) for r in rs), _mean_spread([r["final_loss"] for r in rs]),
                      _mean_spread(vl), _mean_spread([math.exp(x) for x in vl], ".1f"), f"{statistics.mean(tps):,.0f}")
    return table


def runs_table(rows: list[dict]) -> harness.Table:
    table = harness.Table(title="Runs", columns=["run", "train loss", "validation loss", "tokens/s", "train seconds"],
                          right={1, 2, 3, 4})
    for r in rows:
        table.add_row(r["run"], f"{r['final_loss']:.4f}", f"{r['val_loss']:.4f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['train_seconds']:.0f}")
    return table


def _model_source(row: dict) -> str:
    """How the runs' models were chosen: ``preset `340m-*` `` or ``config `efla.json` `` (``--config``)."""
    if row.get("preset"):
        return f"preset `{row['preset'].split('-')[0]}-*`"
    return f"config `{os.path.basename(row.get('config') or '?')}`"


def summary_markdown(rows: list[dict], title: str, notes: str, command_line: str) -> str:
    r0 = rows[0]
    lines = [f"# {title}", "",
             f"{len(rows)} runs; each: {_model_source(r0)} "
             f"({r0['n_params']:,} parameters with this vocabulary), {r0['steps']} steps, "
             f"{r0['tokens']:,} training tokens (sequence length {r0['resolved'].get('seq_len')}, "
             f"{r0['resolved'].get('batch_tokens')} tokens per step).", "",
             *variants_table(rows).markdown(), "",
             "Mean ± sample standard deviation over seeds (model initialisation; the data order is the same "
             "for every run). Per-run numbers: `lm_losses.json` / `lm_losses.csv`; curves: `lm_loss_curves.png`.",
             "", *runs_table(rows).markdown()]
    if notes:
        lines += ["", notes.rstrip()]
    if command_line:
        lines += ["", f"Report written by: `{command_line}`"]
    return "\n".join(lines) + "\n"


def write_lm_report(run_dirs: list[str], out: str, title: str = "Language modelling", notes: str = "",
                    command_line: str = "") -> list[str]:
    """``lm_losses.json``, ``lm_losses.csv``, ``lm_loss_curves.png`` and ``summary.md`` for runs of
    :func:`efla.experiments.lm.train.train` (grouped by variant; mean and spread over seeds).
    Returns the paths written."""
    rows = collect_runs(run_dirs)
    if not rows:
        raise ValueError("runs: none of them has finished (no train_summary.json)")
    os.makedirs(out, exist_ok=True)
    files = {name: os.path.join(out, name) for name in ("lm_losses.json", "lm_losses.csv", "lm_loss_curves.png",
                                                       "summary.md")}
    harness.atomic_write_json(files["lm_losses.json"], dict(title=title, runs=rows,
                                                            versions=harness.versions("transformers")), indent=2)
    harness.atomic_write_csv(files["lm_losses.csv"], ["run", "variant", "seed", "step", "tokens", "train_loss",
                                                      "val_loss"], _csv_rows(rows))
    plot_loss_curves(rows, title, files["lm_loss_curves.png"])
    harness.atomic_write(files["summary.md"], summary_markdown(rows, title, notes, command_line))
    return list(files.values())
