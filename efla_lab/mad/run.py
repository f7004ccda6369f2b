"""Orchestration of the MAD benchmark: presets, the lr x wd grid and resumable runs (the scores and
output files are in :mod:`efla_lab.mad.report`).

Every finished run is stored as ``<out>/runs/<key>.json``; re-invoking with the same output
directory skips those runs, and those of ``<out>/runs.jsonl`` (a recorded experiment's runs in one
file, ``RECORDED_RUNS``: ``--report-only`` over a record reads them there). A run in progress keeps
its state in ``<out>/partial/<key>.pt`` (at most a minute old) and continues from there when
re-invoked after a kill.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field

from efla_lab.data.mad_tasks import TASKS, MADSetting, baseline_setting, benchmark_settings, make_dataset
from efla.variants import label

from efla_lab import harness
from efla_lab.mad.model import RULES, STREAMS_PER_DEVICE
from efla_lab.mad.training import MADRun, RunConfig, train_side_by_side

GRID_LRS = (1e-4, 5e-4, 1e-3)
GRID_WDS = (0.0, 0.1)

# tiny settings (CI): every task at a few dozen sequences of 16-32 tokens
_TINY = {
    "in-context-recall": MADSetting("in-context-recall", 16, 32, 96, 32),
    "fuzzy-in-context-recall": MADSetting("fuzzy-in-context-recall", 16, 32, 96, 32, k_motif_size=3, v_motif_size=3),
    "noisy-in-context-recall": MADSetting("noisy-in-context-recall", 32, 32, 96, 32, frac_noise=0.2, noise_vocab_size=16),
    "selective-copying": MADSetting("selective-copying", 16, 32, 96, 32, num_tokens_to_copy=4),
    "compression": MADSetting("compression", 16, 16, 96, 32),
    "memorization": MADSetting("memorization", 32, 16, 64, 32),
}


@dataclass
class Preset:
    name: str
    description: str
    all_settings: bool = False  # False: the baseline setting of each task
    lrs: tuple = GRID_LRS
    wds: tuple = GRID_WDS
    epochs: int = 200
    max_steps: int | None = None  # epochs = clamp(max_steps // steps_per_epoch, 1, epochs)
    batch_size: int = 128
    width: int = 128
    tiny: bool = False


PRESETS = {
    "tiny": Preset(
        "tiny",
        "CI smoke test: tiny settings, width 32, 2 epochs, one lr",
        lrs=(1e-3,),
        wds=(0.0,),
        epochs=2,
        batch_size=32,
        width=32,
        tiny=True,
    ),
    "quick": Preset(
        "quick",
        "baseline setting of each task, lr 1e-3, wd 0, a budget of 300 optimizer steps "
        "(3 epochs of the 12,800-example tasks, 150 of memorization)",
        lrs=(1e-3,),
        wds=(0.0,),
        max_steps=300,
    ),
    "baseline": Preset("baseline", "baseline setting of each task, full 3 lr x 2 wd grid, 200 epochs"),
    "paper": Preset("paper", "all 66 settings of the MAD protocol, full grid, 200 epochs (396 runs per rule)", all_settings=True),
}


@dataclass
class MADOptions:
    preset: str = "quick"
    tasks: list = field(default_factory=lambda: list(TASKS))
    rules: list = field(default_factory=lambda: ["exact", "euler"])
    num_heads: int = 8
    blocks: int = 2
    lrs: list | None = None  # overrides of the preset
    wds: list | None = None
    epochs: int | None = None
    max_steps: int | None = None
    width: int | None = None
    batch_size: int | None = None
    precision: str = "fp32"
    seed: int = 12345
    device: str = "cpu"
    time_limit: float | None = None  # seconds per run
    cuda_graph: bool = False  # replay training steps and test batches from CUDA graphs (CUDA devices)
    together: int = 1  # runs trained side by side in this process (own CUDA streams on a GPU)
    train: bool = True  # False: only aggregate the stored runs
    settings: list | None = None  # only these setting ids (e.g. "M-v1024-l32-n256"); None: all of the preset's


def settings_for(preset: Preset, task: str) -> list[MADSetting]:
    if preset.tiny:
        return [_TINY[task]]
    return benchmark_settings(task) if preset.all_settings else [baseline_setting(task)]


def chosen_settings(opts: MADOptions) -> list[MADSetting]:
    """The preset's settings of ``opts.tasks``, narrowed to ``opts.settings`` when given."""
    every = [s for task in opts.tasks for s in settings_for(PRESETS[opts.preset], task)]
    if opts.settings is None:
        return every
    known = {s.id for s in every}
    unknown = [sid for sid in opts.settings if sid not in known]
    if unknown:
        raise ValueError(
            f"settings: {', '.join(unknown)} not among the {opts.preset} preset's settings of these "
            f"tasks ({', '.join(sorted(known))})"
        )
    return [s for s in every if s.id in opts.settings]


def _epochs_for(setting: MADSetting, epochs: int, max_steps: int | None, batch_size: int) -> int:
    if max_steps is None:
        return epochs
    steps_per_epoch = math.ceil(setting.num_train_examples / batch_size)
    return max(1, min(epochs, max_steps // steps_per_epoch))


def plan(opts: MADOptions) -> list[RunConfig]:
    """All runs of the options, grouped by setting (so each dataset is generated once)."""
    if opts.preset not in PRESETS:
        raise ValueError(f"preset: expected one of {list(PRESETS)}, got {opts.preset!r}")
    for t in opts.tasks:
        if t not in TASKS:
            raise ValueError(f"tasks: expected names from {TASKS}, got {t!r}")
    for r in opts.rules:
        if r not in RULES:
            raise ValueError(f"rules: expected names from {RULES}, got {r!r}")
    p = PRESETS[opts.preset]
    lrs = opts.lrs or p.lrs
    wds = opts.wds if opts.wds is not None else p.wds
    bs = opts.batch_size or p.batch_size
    width = opts.width or p.width
    epochs = opts.epochs or p.epochs
    max_steps = opts.max_steps if opts.max_steps is not None else (None if opts.epochs else p.max_steps)
    runs = []
    for s in chosen_settings(opts):
        e = _epochs_for(s, epochs, max_steps, bs)
        for lr in lrs:
            for wd in wds:
                for rule in opts.rules:
                    runs.append(
                        RunConfig(
                            setting=s,
                            rule=rule,
                            lr=lr,
                            weight_decay=wd,
                            epochs=e,
                            batch_size=bs,
                            width=width,
                            num_heads=opts.num_heads,
                            blocks=opts.blocks,
                            seed=opts.seed,
                            precision=opts.precision,
                        )
                    )
    return runs


def versions() -> dict:
    return harness.versions("numpy")


def run_path(out_dir: str, cfg: RunConfig) -> str:
    return os.path.join(out_dir, "runs", cfg.key + ".json")


def partial_path(out_dir: str, cfg: RunConfig) -> str:
    """Where an unfinished run keeps its state between calls (removed when it finishes)."""
    return os.path.join(out_dir, "partial", cfg.key + ".pt")


RECORDED_RUNS = "runs.jsonl"
_recorded_cache: dict[str, tuple[int, dict]] = {}


def recorded_runs(out_dir: str) -> dict[str, dict]:
    """``<out>/runs.jsonl``'s runs by key (read again only when the file changed)."""
    path = os.path.join(out_dir, RECORDED_RUNS)
    if not os.path.exists(path):
        return {}
    stamp = os.stat(path).st_mtime_ns
    held = _recorded_cache.get(path)
    if held is None or held[0] != stamp:
        held = _recorded_cache[path] = (stamp, {run["key"]: run for run in harness.read_records(path)})
    return held[1]


def load_run(out_dir: str, cfg: RunConfig, time_limit: float | None = None, any_stored: bool = False) -> dict | None:
    """The stored result of ``cfg`` if it counts as finished: complete, or truncated by a time
    limit at least as long as ``time_limit`` (``any_stored``: every stored result counts). A run
    file of its own wins over the record's line."""
    p = run_path(out_dir, cfg)
    if os.path.exists(p):
        with open(p) as f:
            res = json.load(f)
    else:
        res = recorded_runs(out_dir).get(cfg.key)
    if res is None:
        return None
    if res.get("truncated") and not any_stored and (time_limit is None or (res.get("time_limit") or 0) < time_limit):
        return None
    return res


def run_mad(opts: MADOptions, out_dir: str, progress_factory=None, log=None) -> dict:
    """Run (or resume) every run of ``opts``; returns ``{"runs": [...], "missing": [...], ...}``."""
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    cfgs = plan(opts)
    report_only = not opts.train
    todo = [c for c in cfgs if load_run(out_dir, c, opts.time_limit, report_only) is None]
    if log:
        log(
            f"{len(cfgs)} runs planned, {len(cfgs) - len(todo)} already stored in {out_dir}/runs, "
            f"{len(todo) if opts.train else 0} to train"
        )
    if opts.train and str(opts.device).startswith("cuda") and opts.together > STREAMS_PER_DEVICE:
        raise ValueError(
            f"together: at most {STREAMS_PER_DEVICE} runs side by side on a GPU (a CUDA stream each), got {opts.together}"
        )
    if opts.train and opts.together > 1 and opts.time_limit is not None:
        raise ValueError(
            "time_limit: a limit per run needs runs trained one at a time (together = 1); side by side "
            "each run's clock would count the whole group's time"
        )
    if opts.train:
        datasets: dict = {}
        for group in _side_by_side_groups(todo, opts.together):
            datasets = _datasets_for(group, datasets)
            _train_group(group, datasets, cfgs, opts, out_dir, progress_factory, log)
    results, missing = [], []
    for cfg in cfgs:
        res = load_run(out_dir, cfg, opts.time_limit, report_only)
        if res is None:
            missing.append(cfg.key)
        else:
            results.append(res)
    return {
        "options": opts.__dict__,
        "preset": PRESETS[opts.preset].__dict__,
        "runs": results,
        "missing": missing,
        "versions": versions(),
    }


def _side_by_side_groups(todo: list[RunConfig], size: int) -> list[list[RunConfig]]:
    """The runs in plan order, ``size`` at a time (the last group may be smaller)."""
    return [todo[i : i + size] for i in range(0, len(todo), size)]


def _datasets_for(group: list[RunConfig], made: dict) -> dict:
    """The datasets of the group's settings by id, taken from ``made`` where there (the plan keeps a
    setting's runs together, so each dataset is made once)."""
    out: dict = {}
    for c in group:
        if c.setting.id not in out:
            out[c.setting.id] = made[c.setting.id] if c.setting.id in made else make_dataset(c.setting, seed=c.seed)
    return out


def _train_group(
    group: list[RunConfig], datasets: dict, cfgs: list[RunConfig], opts: MADOptions, out_dir: str, progress_factory, log
) -> None:
    """Train the runs of one group side by side and store each result as its run ends (its partial
    state then goes)."""
    descs = {
        c.key: f"[{cfgs.index(c) + 1}/{len(cfgs)}] {c.setting.id} {label(c.rule)} lr={c.lr:g} wd={c.weight_decay:g}"
        for c in group
    }
    n_steps = sum(c.epochs * math.ceil(c.setting.num_train_examples / c.batch_size) for c in group)
    desc = descs[group[0].key] if len(group) == 1 else f"{len(group)} runs side by side"
    bar = progress_factory(total=n_steps, desc=desc) if progress_factory else None

    def store(run) -> None:
        res, cfg = run.result(), run.cfg
        harness.atomic_write(run_path(out_dir, cfg), json.dumps(res))
        with contextlib.suppress(FileNotFoundError):  # stored: its partial state is done with
            os.remove(partial_path(out_dir, cfg))
        if log:
            log(
                f"{descs[cfg.key]}: test acc {res['test_acc']:.4f} (best-ppl epoch {res['best_epoch']}/"
                f"{res['epochs_run']}{', early stop' if res['stopped_early'] else ''}"
                f"{', TRUNCATED' if res['truncated'] else ''}) in {res['seconds']:.0f} s"
            )

    try:
        runs = [
            MADRun(
                c,
                datasets[c.setting.id],
                device=opts.device,
                time_limit=opts.time_limit,
                bar=bar,
                checkpoint=partial_path(out_dir, c),
                cuda_graph=opts.cuda_graph,
            )
            for c in group
        ]
        for run in runs:  # a run resumed complete ends here
            if run.done:
                store(run)
        train_side_by_side(runs, on_done=store)
    finally:
        if bar is not None:
            bar.close()
