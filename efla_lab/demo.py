"""``efla demo``: a small, offline, CPU-sized tour of what exact flow changes.

(a) the one-step picture (exact vs Euler across beta*lambda), (b) EFLA vs DeltaNet trained
briefly on the embedded 8x8 digits and evaluated under intensity scaling and noise, (c) a short
MAD task when the MAD module is available, (d) CPU timings of the ops. Returns plain results;
``write_demo_outputs`` writes demo.json, PNG plots and report.md, and is called after every part, so
an interrupted demo keeps the parts it finished.
"""

from __future__ import annotations

import os
import time

from efla_lab.data.pixels import load_digits_sequences
from efla_lab.data.mad_tasks import MADSetting, make_dataset
from efla.variants import label
from efla_lab.style import colour

from efla_lab import harness
from efla_lab.mad.training import RunConfig, train_run
from efla_lab.onestep import one_step_table
from efla_lab.robustness.model import TrainConfig, evaluate_perturbations, train_classifier
from efla_lab.timing import op_timings

# `efla demo` from a fresh clone on an idle 2-core x86-64 CPU, torch 2.13, 2 threads
# (106-110 s on 2026-12-03; 45-49 s on an earlier VM)
MEASURED_SECONDS = 110
# share of the demo's time each part takes (measured alongside MEASURED_SECONDS)
PART_SHARE = {"one_step": 0.01, "robustness": 0.40, "mad": 0.54, "cpu_timings": 0.05}
# Fewer epochs than this is a smoke run: the MAD part trains as few epochs and one small shape is timed.
SMOKE_EPOCHS = 3
SMOKE_TIMING_SHAPES = ((1, 128, 2, 32),)
PART_TITLE = {"one_step": "(a) one step", "robustness": "(b) digits", "mad": "(c) MAD recall", "cpu_timings": "(d) CPU timings"}


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def current_load(window_s: float = 0.3) -> float:
    """How many cores other programs keep busy now: sampled from /proc/stat over ``window_s``, or
    the 1-minute load average where /proc/stat is missing. (The load average lags by a minute, so
    right after an install it still counts the installer's work.)"""
    before = _cpu_times()
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window_s)
    after = _cpu_times()
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


def threads_for_load(cpus: int, load: float) -> int:
    """CPU threads for a machine with ``cpus`` cores of which ``load`` are busy with other work: the
    cores nobody else is using, at least one."""
    return max(1, min(cpus, cpus - int(round(load))))


def projected_rest(res: dict, elapsed: float) -> float:
    """Estimated seconds left: from the time the finished parts took and their share of the whole, or
    from the measured time while too little is finished to go by."""
    done = sum(share for part, share in PART_SHARE.items() if part in res)
    if done < 0.1:
        return MEASURED_SECONDS * (1.0 - done)
    return elapsed * (1.0 - done) / done


DEMO_LEVELS = {"scale": [1.0, 2.0, 3.0, 5.0, 10.0], "noise": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]}


def run_mad_demo_task(quick: bool = False, epochs: int | None = None, progress_factory=None) -> dict:
    """In-context recall at a small size (vocab 16, length 64, 1024 training sequences), EFLA vs
    DeltaNet with the MAD backbone (width 64, 4 heads) and the MAD recipe, on the CPU."""

    setting = MADSetting("in-context-recall", 16, 64, num_train_examples=1024, num_test_examples=256)
    dataset = make_dataset(setting)
    epochs = epochs or (6 if quick else 12)
    out = {"task": "in-context recall (v16, L64, 1024 train)", "epochs": epochs}
    for rule in ("exact", "euler"):
        cfg = RunConfig(setting=setting, rule=rule, lr=3e-3, epochs=epochs, batch_size=64, width=64, num_heads=4)
        bar = progress_factory(total=epochs * 16, desc=f"MAD recall {label(rule)}") if progress_factory else None
        run = train_run(cfg, dataset=dataset, bar=bar)
        if bar:
            bar.close()
        out[rule] = run["test_acc"]
    return out


def run_demo(
    quick: bool = False, progress_factory=None, log=lambda _msg: None, epochs: int | None = None, on_part_done=lambda _res: None
) -> dict:
    """Runs the four parts; ``on_part_done(res)`` is called after each with the results so far."""

    smoke = epochs is not None and epochs < SMOKE_EPOCHS
    mad_epochs = epochs if smoke else None
    timing_shapes = SMOKE_TIMING_SHAPES if smoke else None

    t0 = time.perf_counter()
    res: dict = {"quick": quick}

    def finished(part: str) -> None:
        res["seconds"] = time.perf_counter() - t0
        left = projected_rest(res, res["seconds"])
        log(f"{PART_TITLE[part]} done at {res['seconds']:.0f} s" + (f"; about {left:.0f} s left" if left >= 1 else ""))
        on_part_done(res)

    log("(a) one step: exact flow vs Euler")
    res["one_step"] = one_step_table()
    finished("one_step")

    log("(b) EFLA vs DeltaNet on the embedded 8x8 digits (scikit-learn, no download)")
    data = load_digits_sequences()
    epochs = epochs or (12 if quick else 30)
    robustness = {
        "dataset": data.source,
        "n_train": len(data.x_train),
        "n_test": len(data.x_test),
        "epochs": epochs,
        "lr": 3e-3,
        "levels": DEMO_LEVELS,
        "rules": {},
    }
    for rule in ("exact", "euler"):
        cfg = TrainConfig(rule=rule, lr=3e-3, epochs=epochs, batch_size=64, width=64, seed=0)
        steps = epochs * -(-len(data.x_train) // cfg.batch_size)
        bar = progress_factory(total=steps, desc=f"train {label(rule)}") if progress_factory else None
        model, tr = train_classifier(data, cfg, progress=bar.update if bar else None)
        if bar:
            bar.close()
        ev = evaluate_perturbations(model, data, DEMO_LEVELS)
        stiff = model.stiffness(data.x_test[:200] * 5.0)
        robustness["rules"][rule] = dict(
            losses=tr.losses,
            final_train_loss=tr.final_train_loss,
            eval=ev,
            stiffness_x5_median=stiff.median().item(),
            stiffness_x5_max=stiff.max().item(),
        )
    res["robustness"] = robustness
    finished("robustness")

    log("(c) a short MAD task: in-context recall (small setting)")
    res["mad"] = run_mad_demo_task(quick=quick, epochs=mad_epochs, progress_factory=progress_factory)
    finished("mad")

    log("(d) CPU timings of the ops")
    shapes = timing_shapes or (((1, 256, 4, 64), (1, 1024, 4, 64)) if quick else ((1, 512, 4, 64), (1, 2048, 4, 64)))
    res["cpu_timings"] = op_timings(shapes=shapes, reps=2 if quick else 3)
    finished("cpu_timings")
    return res


def side_by_side(res: dict) -> list[tuple[str, str, str]]:
    """Rows (metric, EFLA, DeltaNet) for the one summary table."""
    rows = []
    if "robustness" not in res:
        return rows
    rb = res["robustness"]["rules"]
    e, d = rb["exact"]["eval"], rb["euler"]["eval"]
    rows.append(("digits: clean test accuracy", f"{e['clean']:.3f}", f"{d['clean']:.3f}"))
    for kind in ("scale", "noise"):
        for lv, ae, ad in zip(e[kind]["levels"], e[kind]["accuracy"], d[kind]["accuracy"]):
            if (kind == "scale" and lv in (2.0, 5.0, 10.0)) or (kind == "noise" and lv in (0.4, 1.0)):
                rows.append((f"digits: accuracy, {kind} {lv:g}", f"{ae:.3f}", f"{ad:.3f}"))
        me = sum(e[kind]["accuracy"]) / len(e[kind]["accuracy"])
        md = sum(d[kind]["accuracy"]) / len(d[kind]["accuracy"])
        rows.append((f"digits: mean accuracy over {kind} levels", f"{me:.3f}", f"{md:.3f}"))
    rows.append(
        (
            "digits: median beta*||k||^2 at x5 intensity",
            f"{rb['exact']['stiffness_x5_median']:.2f}",
            f"{rb['euler']['stiffness_x5_median']:.2f}",
        )
    )
    return rows + _mad_rows(res)


def _mad_rows(res: dict) -> list[tuple[str, str, str]]:
    rows = []
    if res.get("mad"):
        m = res["mad"]
        rows.append((f"MAD {m['task']}: test accuracy", f"{m['exact']:.3f}", f"{m['euler']:.3f}"))
    return rows


def _plots(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    if "one_step" in res:
        files.append(_plot_one_step(res["one_step"], out_dir, plt))
    if "robustness" in res:
        files.append(_plot_robustness(res["robustness"], out_dir, plt))
    return files


def _plot_one_step(rows: list, out_dir: str, plt) -> str:
    x = [r["beta_lambda"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(x, [r["euler_eigenvalue"] for r in rows], "o-", color=colour("euler"), label="Euler (DeltaNet): 1 - βλ")
    axes[0].plot(x, [r["exact_eigenvalue"] for r in rows], "o-", color=colour("exact"), label="exact (EFLA): exp(-βλ)")
    axes[0].axhline(-1, color="gray", ls=":", lw=1)
    axes[0].axhline(1, color="gray", ls=":", lw=1)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("stiffness β·||k||²")
    axes[0].set_ylabel("eigenvalue of the transition along k")
    axes[0].set_title("One step: |eigenvalue| > 1 expands the state")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    axes[1].loglog(x, [r["one_step_rel_diff"] for r in rows], "o-", color="black")
    axes[1].set_xlabel("stiffness β·||k||²")
    axes[1].set_ylabel("||S_exact − S_Euler|| / ||S_0||")
    axes[1].set_title("Exact minus Euler after one step (~ (βλ)² when small)")
    axes[1].grid(alpha=0.3, which="both")
    fig.tight_layout()
    p = os.path.join(out_dir, "one_step.png")
    harness.atomic_save_figure(fig, p)
    return p


def _plot_robustness(rb: dict, out_dir: str, plt) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, lab in zip(axes, ("scale", "noise"), ("intensity scale (x)", "Gaussian noise std")):
        for rule in ("exact", "euler"):
            ev = rb["rules"][rule]["eval"][kind]
            ax.plot(ev["levels"], ev["accuracy"], "o-", color=colour(rule), label=label(rule))
        ax.set_xlabel(lab)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"accuracy vs {lab}")
    fig.suptitle(f"Embedded 8x8 digits ({rb['n_train']} train, {rb['epochs']} epochs, 1 seed, lr {rb['lr']:g})")
    fig.tight_layout()
    p = os.path.join(out_dir, "robustness.png")
    harness.atomic_save_figure(fig, p)
    return p


def write_demo_outputs(res: dict, out_dir: str) -> list[str]:
    """demo.json, the plots and report.md of the parts in ``res`` so far (each file replaced atomically)."""
    os.makedirs(out_dir, exist_ok=True)
    files = _plots(res, out_dir)
    p = os.path.join(out_dir, "demo.json")
    harness.atomic_write_json(p, res)
    files.append(p)
    p = os.path.join(out_dir, "report.md")
    harness.atomic_write(p, "\n".join(_report_lines(res)))
    files.append(p)
    return files


def one_step_rows_table(res: dict) -> harness.Table:
    table = harness.Table(
        title="(a) One step: exact flow vs Euler",
        columns=["β·λ", "Euler eigenvalue 1−βλ", "EFLA eigenvalue exp(−βλ)", "‖S_exact − S_Euler‖/‖S_0‖", "Euler"],
        right={0, 1, 2, 3, 4},
    )
    for r in res["one_step"]:
        table.add_row(
            f"{r['beta_lambda']:g}",
            f"{r['euler_eigenvalue']:+.4f}",
            f"{r['exact_eigenvalue']:.4f}",
            f"{r['one_step_rel_diff']:.2e}",
            "[red]expands[/red]" if r["euler_expands"] else "contracts",
        )
    return table


def side_by_side_table(res: dict) -> harness.Table:
    table = harness.Table(
        title="(b, c) EFLA vs DeltaNet, side by side (small CPU runs, one seed)",
        columns=["metric", "EFLA", "DeltaNet"],
        right={1, 2},
    )
    for row in side_by_side(res) or _mad_rows(res):
        table.add_row(*row)
    return table


def timings_table(res: dict) -> harness.Table:
    table = harness.Table(
        title="(d) CPU time, float32 (median ms)",
        columns=["[B, T, H, D]", "chunk fwd", "recurrent fwd", "chunk fwd+bwd", "recurrent fwd+bwd"],
        right={0, 1, 2, 3, 4},
    )
    for t in res["cpu_timings"]:
        table.add_row(
            str(t["shape"]),
            f"{t['chunk_fwd_ms']:.1f}",
            f"{t['recurrent_fwd_ms']:.1f}",
            f"{t['chunk_fwd_bwd_ms']:.1f}",
            f"{t['recurrent_fwd_bwd_ms']:.1f}",
        )
    return table


def demo_tables(res: dict) -> list[harness.Table]:
    """The tables of the parts finished so far, for the console and report.md alike."""
    tables = []
    if "one_step" in res:
        tables.append(one_step_rows_table(res))
    if "robustness" in res or "mad" in res:
        tables.append(side_by_side_table(res))
    if "cpu_timings" in res:
        tables.append(timings_table(res))
    return tables


def _report_lines(res: dict) -> list[str]:
    lines = [
        "# EFLA demo",
        "",
        "A small CPU demonstration (minutes, no downloads). The full experiments are `efla robustness`, "
        "`efla lr-sweep`, `efla mad`, `efla train` and `efla eval` (see the README).",
        "",
    ]
    if "one_step" in res:
        lines += ["## One step: exact flow vs Euler", "", "![one step](one_step.png)", "", *one_step_rows_table(res).markdown()]
    if "robustness" in res or "mad" in res:
        lines += ["", "## EFLA vs DeltaNet", ""] + (["![robustness](robustness.png)", ""] if "robustness" in res else [])
        lines += side_by_side_table(res).markdown()
    if "cpu_timings" in res:
        lines += ["", "## CPU timings (float32, median ms)", "", *timings_table(res).markdown()]
    missing = [PART_TITLE[p] for p in PART_SHARE if p not in res]
    if missing:
        lines += ["", f"Not finished yet: {', '.join(missing)} (the demo was still running or was interrupted)."]
    lines += [
        "",
        f"{'Time so far' if missing else 'Total time'}: {res.get('seconds', 0):.0f} s. "
        "One seed on a tiny dataset: read it as an illustration, "
        "not as evidence; `docs/results/` holds the recorded runs.",
        "",
    ]
    return lines
