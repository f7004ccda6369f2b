"""``efla lm-report``: loss curves and a summary table of finished ``efla train`` runs, grouped by variant."""

from __future__ import annotations

import json
import math
import os
import statistics

from efla.variants import VARIANTS, label
from efla_lab.style import colour

from efla_lab import harness
from efla.training.trainer import read_log, throughput

__all__ = ["collect_runs", "stored_run", "write_lm_report"]

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


# (key in a run's row, section of eval.json, field): what `efla eval` measured, when it ran
EVAL_FIELDS = (
    ("wikitext_word_ppl", "wikitext", "word_perplexity"),
    ("wikitext_bpb", "wikitext", "bits_per_byte"),
    ("wikitext_token_ppl", "wikitext", "token_perplexity"),
    ("lambada_acc", "lambada", "accuracy"),
    ("lambada_ppl", "lambada", "perplexity"),
)


def eval_numbers(ev: dict | None) -> dict:
    """``efla eval``'s numbers for a run (from its ``eval.json``; ``{}`` where it has none), plus
    what limited them (``eval_limits``: a truncated WikiText or a LAMBADA subset)."""
    if not ev:
        return {}
    out = {key: (ev.get(section) or {}).get(field) for key, section, field in EVAL_FIELDS}
    limits = []
    wiki, lam = ev.get("wikitext") or {}, ev.get("lambada") or {}
    if wiki.get("truncated_to_tokens"):
        limits.append(f"WikiText: first {wiki['tokens']:,} tokens")
    if lam.get("limit"):
        total = lam.get("passages_in_file")
        limits.append(f"LAMBADA: {lam['n']:,} of {f'{total:,}' if total else 'all'} passages")
    out["eval_limits"] = limits
    out["eval_context"] = ev.get("resolved_context")
    return out


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def stored_run(run_dir: str) -> dict | None:
    """A finished ``efla train`` run's files as one record (``None`` while unfinished, or stopped by
    ``--time-limit`` before its last step): its name,
    ``train_summary``, ``train_args``, model ``config``, ``eval`` (``<run>/eval/eval.json``) and
    ``log``: what a recorded experiment keeps per run as a line of its ``runs.jsonl``."""
    summary = _read_json(os.path.join(run_dir, "train_summary.json"))
    if summary is None or summary.get("stopped_early"):
        return None
    return dict(
        run=os.path.basename(os.path.normpath(run_dir)),
        train_summary=summary,
        train_args=_read_json(os.path.join(run_dir, "train_args.json")),
        config=_read_json(os.path.join(run_dir, "config.json")),
        eval=_read_json(os.path.join(run_dir, "eval", "eval.json")),
        log=read_log(run_dir),
    )


def _stored_runs(source: str) -> list[dict]:
    """The finished runs of ``source``: a run directory, or a record's ``runs.jsonl`` (one
    :func:`stored_run` record per line)."""
    if source.endswith(".jsonl"):
        return [dict(record, dir=source) for record in harness.read_records(source)]
    record = stored_run(source)
    return [] if record is None else [dict(record, dir=source)]


def collect_runs(sources: list[str], tail: int = 20) -> list[dict]:
    """Per run (of run directories or records' ``runs.jsonl``): variant, seed, its loss and
    validation curves and the summary numbers (``final_loss`` is the mean training loss of the
    last ``tail`` steps), and ``efla eval``'s numbers where the run has them (:func:`eval_numbers`)."""
    rows = []
    for record in (r for source in sources for r in _stored_runs(source)):
        summ, args = record["train_summary"], record["train_args"]
        log = [e for e in record["log"] if "error" not in e]
        curve = [(e["step"], e["tokens"], e["loss"]) for e in log]
        val = [(e["step"], e["tokens"], e["val_loss"]) for e in log if "val_loss" in e]
        last = [c[2] for c in curve[-tail:]]
        tokens_per_s, train_seconds = _rate_and_seconds(summ, args, log)
        rows.append(
            dict(
                run=record["run"],
                dir=record["dir"],
                variant=summ["variant"],
                seed=args["seed"],
                preset=args.get("preset"),
                config=args.get("config_file"),
                steps=summ["steps"],
                tokens=summ["tokens"],
                n_params=summ["n_params"],
                final_loss=sum(last) / len(last) if last else None,
                val_loss=summ["val_loss"],
                tokens_per_s=tokens_per_s,
                threads=summ.get("threads"),
                train_seconds=train_seconds,
                resolved=args.get("resolved", {}),
                curve=curve,
                val_curve=val,
                data=summ.get("data"),
                **eval_numbers(record["eval"]),
            )
        )
    return rows


def _rate_and_seconds(summ: dict, args: dict, log: list[dict]) -> tuple[float | None, float | None]:
    """Steady-state tokens/s and training seconds of a run. With every step in the log (the default
    ``--log-every 1``), both come from the log, so a run trained in several processes (or resumed
    with nothing left to train, which measures nothing) is counted whole; otherwise from the
    summary of the process that finished it."""
    step_seconds = [e["step_s"] for e in log if e.get("step_s")]
    batch_tokens = args.get("resolved", {}).get("batch_tokens")
    if batch_tokens and step_seconds and len(step_seconds) == summ["steps"]:
        return throughput(step_seconds, batch_tokens)["tokens_per_s"], sum(step_seconds)
    return summ.get("tokens_per_s"), summ.get("train_seconds_this_process")


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
        axes[0].plot(toks, _smooth([x for _, _, x in r["curve"]], 20), color=colour(r["variant"]), lw=1.0, alpha=0.8, label=lab)
        axes[1].plot(
            [t / 1e6 for _, t, _ in r["val_curve"]],
            [x for _, _, x in r["val_curve"]],
            marker=".",
            color=colour(r["variant"]),
            lw=1.0,
            alpha=0.8,
            label=lab,
        )
    axes[0].set(xlabel="training tokens (M)", ylabel="training loss (20-step moving average)", title="training loss")
    axes[1].set(xlabel="training tokens (M)", ylabel="validation loss (held-out sequences)", title="validation loss")
    lo = min(min(x for _, _, x in r["curve"][len(r["curve"]) // 4 :]) for r in rows)
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


def _mean_spread(xs, several_seeds: bool, fmt=".4f") -> str:
    """The mean of ``xs`` (``None`` left out), with the sample standard deviation only over different seeds."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1 or not several_seeds:
        return f"{statistics.mean(xs):{fmt}}"
    return f"{statistics.mean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"


def _several_seeds(rs: list[dict]) -> bool:
    return len({r["seed"] for r in rs}) > 1


def _by_variant(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    return [(v, [r for r in rows if r["variant"] == v]) for v in LM_VARIANTS if any(r["variant"] == v for r in rows)]


def _has_eval(rows: list[dict]) -> bool:
    return any(r.get("wikitext_word_ppl") is not None or r.get("lambada_acc") is not None for r in rows)


def _params(rs: list[dict]) -> str:
    counts = sorted({r["n_params"] for r in rs})
    return f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"


def variants_table(rows: list[dict]) -> harness.Table:
    """Per variant: seeds, parameters, final train and validation loss, validation perplexity,
    tokens/s, and (where the runs were evaluated) WikiText word perplexity, bits per byte and
    LAMBADA accuracy and perplexity."""
    evals = _has_eval(rows)
    columns = [
        "model",
        "seeds",
        "parameters",
        "final train loss (mean of last 20 steps)",
        "final validation loss",
        "validation ppl",
        "tokens/s per run (as run, see below)",
    ]
    if evals:
        columns += ["WikiText word ppl", "WikiText bits/byte", "LAMBADA acc", "LAMBADA ppl"]
    table = harness.Table(title="Language modelling by variant", columns=columns, right=set(range(2, len(columns))))
    for v, rs in _by_variant(rows):
        seeds = _several_seeds(rs)
        vl = [r["val_loss"] for r in rs if r["val_loss"] is not None]
        tps = [r["tokens_per_s"] for r in rs if r["tokens_per_s"]]
        cells = [
            label(v),
            ", ".join(str(r["seed"]) for r in rs),
            _params(rs),
            _mean_spread([r["final_loss"] for r in rs], seeds),
            _mean_spread(vl, seeds),
            _mean_spread([math.exp(x) for x in vl], seeds, ".1f"),
            f"{statistics.mean(tps):,.0f}" if tps else "n/a",
        ]
        if evals:
            cells += [
                _mean_spread([r.get("wikitext_word_ppl") for r in rs], seeds, ".1f"),
                _mean_spread([r.get("wikitext_bpb") for r in rs], seeds, ".4f"),
                _mean_spread([r.get("lambada_acc") for r in rs], seeds, ".4f"),
                _mean_spread([r.get("lambada_ppl") for r in rs], seeds, ".1f"),
            ]
        table.add_row(*cells)
    return table


def runs_table(rows: list[dict]) -> harness.Table:
    evals = _has_eval(rows)
    columns = ["run", "seed", "steps", "training tokens", "train loss", "validation loss", "tokens/s", "train seconds"]
    columns += ["WikiText word ppl", "bits/byte", "LAMBADA acc"] if evals else []
    table = harness.Table(title="Runs", columns=columns, right=set(range(1, len(columns))))
    for r in rows:
        cells = [
            r["run"],
            str(r["seed"]),
            str(r["steps"]),
            f"{r['tokens']:,}",
            f"{r['final_loss']:.4f}",
            _fmt(r["val_loss"], ".4f"),
            _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["train_seconds"], ".0f"),
        ]
        if evals:
            cells += [
                _fmt(r.get("wikitext_word_ppl"), ".1f"),
                _fmt(r.get("wikitext_bpb"), ".4f"),
                _fmt(r.get("lambada_acc"), ".4f"),
            ]
        table.add_row(*cells)
    return table


def _fmt(x, fmt: str) -> str:
    return "n/a" if x is None else f"{x:{fmt}}"


def _model_source(row: dict) -> str:
    """How the runs' models were chosen: ``preset `340m-*` `` or ``config efla.json`` (``--config``; the
    file's name as the run was given it, not a path in this repository, so not set as code)."""
    if row.get("preset"):
        return f"preset `{row['preset'].split('-')[0]}-*`"
    return f"config {os.path.basename(row.get('config') or '?')}"


def _eval_note(rows: list[dict]) -> list[str]:
    if not _has_eval(rows):
        return []
    limits = sorted({lim for r in rows for lim in r.get("eval_limits", [])})
    contexts = sorted({r.get("eval_context") for r in rows if r.get("eval_context")})
    return [
        "",
        "WikiText and LAMBADA: `efla eval` of each run's final model (`<run>/eval/eval.json`; "
        "word perplexity and bits per byte over the raw test text, as lm-evaluation-harness scores them"
        + (f"; context {', '.join(map(str, contexts))} tokens" if contexts else "")
        + (f"; {'; '.join(limits)}" if limits else "")
        + ").",
    ]


def _run_length(rows: list[dict]) -> str:
    """Steps and training tokens: once when every run has the same, else per run."""
    lengths = {(r["steps"], r["tokens"]) for r in rows}
    if len(lengths) == 1:
        steps, tokens = lengths.pop()
        return f", {steps} steps, {tokens:,} training tokens"
    return "; per run: " + ", ".join(f"{r['run']} {r['steps']} steps / {r['tokens']:,} tokens" for r in rows)


def _shapes(rows: list[dict]) -> str:
    shapes = sorted({(r["resolved"].get("seq_len"), r["resolved"].get("batch_tokens")) for r in rows}, key=str)
    return "; ".join(f"sequence length {s}, {b} tokens per step" for s, b in shapes)


def _spread_note(rows: list[dict]) -> str:
    """What the variant table's numbers are: mean ± std over seeds only for variants whose runs differ in seed."""
    groups = _by_variant(rows)
    several = [label(v) for v, rs in groups if _several_seeds(rs)]
    single = [label(v) for v, rs in groups if not _several_seeds(rs)]
    parts = []
    if several:
        parts.append(
            f"{', '.join(several)}: mean ± sample standard deviation over seeds (model initialisation; the "
            "data order is the same for every run)"
        )
    if single:
        parts.append(f"{', '.join(single)}: one seed, no spread (the mean where several runs share it)")
    return "; ".join(parts) + "."


# what makes two runs' training data the same: the tokens, the order of their sequences, how many
# were trained on, and the held-out sequences
SAME_DATA_FIELDS = ("tokens_sha256", "order_sha256", "sequences_trained", "seq_len", "val_sha256")


def data_note(rows: list[dict]) -> list[str]:
    """A line saying whether the runs trained on the same tokens in the same order and were validated
    on the same sequences (from each run's ``train_summary.json`` ``data``); none for runs without it."""
    if not rows or any(not r.get("data") for r in rows):
        return []
    kinds = {tuple(r["data"].get(f) for f in SAME_DATA_FIELDS) for r in rows}
    if len(kinds) > 1:
        differ = [f for i, f in enumerate(SAME_DATA_FIELDS) if len({k[i] for k in kinds}) > 1]
        fields = ", ".join(differ)
        return ["", f"**The runs did not train on the same data**: they differ in {fields} (`train_summary.json` `data`)."]
    d = rows[0]["data"]
    return [
        "",
        f"Same data for every run: {d['sequences_trained']:,} sequences of {d['seq_len']} tokens in the same order "
        f"({d['epochs']:.3f} epochs of {d['train_sequences']:,}; token stream SHA-256 `{d['tokens_sha256'][:16]}`, "
        f"order SHA-256 `{d['order_sha256'][:16]}`), validated on the same {d['val_sequences']:,} sequences "
        "(`train_summary.json` `data`).",
    ]


def summary_markdown(rows: list[dict], title: str, notes: str, command_line: str) -> str:
    sources = sorted({_model_source(r) for r in rows})
    lines = [
        f"# {title}",
        "",
        f"{len(rows)} runs; each: {' or '.join(sources)} (parameters with this vocabulary: see the table)"
        f"{_run_length(rows)} ({_shapes(rows)}).",
        "",
        *variants_table(rows).markdown(),
        "",
        f"{_spread_note(rows)} Per-run numbers: `lm_losses.json` / `lm_losses.csv`; curves: `lm_loss_curves.png`.",
        *data_note(rows),
        *_eval_note(rows),
        "",
        *runs_table(rows).markdown(),
    ]
    if notes:
        lines += ["", notes.rstrip()]
    if command_line:
        lines += ["", f"Report written by: `{command_line}`"]
    return "\n".join(lines) + "\n"


def write_lm_report(
    run_dirs: list[str], out: str, title: str = "Language modelling", notes: str = "", command_line: str = ""
) -> list[str]:
    """``lm_losses.json``, ``lm_losses.csv``, ``lm_loss_curves.png`` and ``summary.md`` for runs of
    :func:`efla.training.trainer.train` (grouped by variant; mean and spread over seeds), and
    ``runs.jsonl``: every run's files as one :func:`stored_run` record per line, the raw record that
    ``--runs runs.jsonl`` reads again. Returns the paths written."""
    rows = collect_runs(run_dirs)
    if not rows:
        raise ValueError("nothing to report: none of the runs has finished (no train_summary.json) (--runs)")
    os.makedirs(out, exist_ok=True)
    names = ("lm_losses.json", "lm_losses.csv", "lm_loss_curves.png", "summary.md", "runs.jsonl")
    files = {name: os.path.join(out, name) for name in names}
    stored = [record for source in run_dirs for record in _stored_runs(source)]
    harness.write_records(files["runs.jsonl"], [{k: v for k, v in r.items() if k != "dir"} for r in stored])
    harness.atomic_write_json(
        files["lm_losses.json"], dict(title=title, runs=rows, versions=harness.versions("transformers")), indent=2
    )
    harness.atomic_write_csv(
        files["lm_losses.csv"], ["run", "variant", "seed", "step", "tokens", "train_loss", "val_loss"], _csv_rows(rows)
    )
    plot_loss_curves(rows, title, files["lm_loss_curves.png"])
    harness.atomic_write(files["summary.md"], summary_markdown(rows, title, notes, command_line))
    return list(files.values())
