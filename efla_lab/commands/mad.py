"""``efla mad``: the MAD synthetic benchmark (six token-manipulation tasks), EFLA vs DeltaNet."""

from __future__ import annotations

from efla.errors import UsageError
from efla import arg_checks as check
from efla_lab.harness import default_device


def add_parser(subparsers) -> None:
    from efla_lab.data.mad_tasks import TASK_ABBR, TASKS
    from efla_lab.mad.run import PRESETS, MADOptions

    abbr = ", ".join(f"{v}={k}" for k, v in TASK_ABBR.items())
    p = subparsers.add_parser(
        "mad",
        help="MAD synthetic benchmark: recall, copying, compression, memorization",
        description="Train [mixer, SwiGLU] x 2 models on the six MAD tasks and score them as MAD does "
        "(max over the lr x wd grid, mean over task settings). Finished runs stored in --out are "
        "not repeated.",
    )
    p.add_argument("--quick", action="store_true", help="the quick preset (same as --preset quick; the default)")
    p.add_argument("--out", default="results/mad", help="output directory (default: results/mad)")
    p.add_argument(
        "--preset", default=None, choices=list(PRESETS), help="; ".join(f"{k}: {v.description}" for k, v in PRESETS.items())
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(TASKS),
        metavar="TASK",
        help=f"tasks by name or abbreviation ({abbr}); default: all six",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="ID",
        help="only these task settings, by the id the results use (e.g. M-v1024-l32-n256); default: every setting of the preset",
    )
    p.add_argument(
        "--rules",
        nargs="+",
        default=["exact", "euler"],
        choices=["exact", "euler", "gated-exact", "gated-euler"],
        help="update rules (exact = EFLA, euler = DeltaNet); default: exact euler",
    )
    p.add_argument("--num-heads", type=int, default=8, help="heads of the mixer (width 128: 8 heads of 16)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="override the preset's learning rates")
    p.add_argument("--wds", type=float, nargs="+", default=None, help="override the preset's weight decays")
    p.add_argument("--epochs", type=int, default=None, help="override the epoch budget (disables the step budget)")
    p.add_argument(
        "--max-steps", type=int, default=None, help="override the step budget: epochs = max_steps // steps per epoch (1..epochs)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=MADOptions.seed,
        help="seed of the data, the initialization and the data order (default %(default)s). Runs of several "
        "seeds can share --out (the seed is in each run's key); results.json, runs.csv and summary.md "
        "there score this seed's runs only",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 = autocast (MAD used bf16)")
    p.add_argument("--device", default=default_device(), help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument(
        "--together",
        type=int,
        default=1,
        metavar="N",
        help="train up to N runs side by side in this process (each in its own CUDA stream on a GPU, "
        "where small models leave most of it idle; at most 32 there); default 1",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each training step and test batch from a CUDA graph (CUDA devices; small models run several times faster)",
    )
    p.add_argument("--time-limit", type=float, default=None, help="seconds per run; a run cut short is marked")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--report-only", action="store_true", help="train nothing; aggregate the runs stored in --out")
    p.set_defaults(func=cmd_mad)


def _resolve_tasks(names):
    from efla_lab.data.mad_tasks import TASK_ABBR, TASKS

    inv = {v.lower(): k for k, v in TASK_ABBR.items()}
    out = []
    for n in names:
        t = inv.get(n.lower(), n)
        if t not in TASKS:
            raise UsageError(f"unknown task {n!r}; expected one of {', '.join(TASKS)} or {', '.join(inv)} (--tasks)")
        if t not in out:
            out.append(t)
    return out


def _check_arguments(args) -> None:
    from efla_lab.mad.model import STREAMS_PER_DEVICE

    _resolve_tasks(args.tasks)
    check.at_least(args.num_heads, 1, "--num-heads")
    check.positive(args.lrs, "--lrs")
    check.at_least(args.wds, 0, "--wds")
    check.at_least(args.epochs, 1, "--epochs")
    check.at_least(args.max_steps, 1, "--max-steps")
    check.at_least(args.seed, 0, "--seed")
    check.positive(args.time_limit, "--time-limit")
    check.at_least(args.threads, 1, "--threads")
    check.at_least(args.together, 1, "--together")
    if args.together > 1 and args.time_limit is not None:
        raise UsageError("--time-limit counts per run, so it needs runs trained one at a time (--together)")
    if str(args.device).startswith("cuda") and args.together > STREAMS_PER_DEVICE and not args.report_only:
        raise UsageError(
            f"at most {STREAMS_PER_DEVICE} runs side by side on a GPU, one CUDA stream each, got {args.together} (--together)"
        )
    check.device(args.device)
    check.output_dir(args.out)
    if args.cuda_graph and not str(args.device).startswith("cuda"):
        raise UsageError(f"CUDA graphs need a CUDA device, got {args.device!r} (--cuda-graph)")
    if args.report_only:
        check.not_ignored(
            args,
            {"together": "--together", "cuda_graph": "--cuda-graph", "threads": "--threads"},
            "with --report-only, which trains nothing",
        )


def _check_settings(opts) -> None:
    from efla_lab.mad.run import chosen_settings

    try:
        chosen_settings(opts)
    except ValueError as e:
        raise UsageError(f"{e} (--settings)") from None


def _check_something_to_report(opts, out: str) -> None:
    """``--report-only`` needs at least one of the planned runs stored in ``out``."""
    from efla_lab.mad.run import load_run, plan

    if not any(load_run(out, cfg, opts.time_limit, any_stored=True) for cfg in plan(opts)):
        raise UsageError(f"nothing to report: {out} holds none of the runs these options plan (--report-only, --out)")


def cmd_mad(args) -> int:
    import torch
    from rich.console import Console

    from efla_lab import harness
    from efla_lab.mad.report import aggregate, scores_table, write_outputs
    from efla_lab.mad.run import MADOptions, run_mad

    console = Console()
    _check_arguments(args)
    if args.quick and args.preset not in (None, "quick"):
        raise UsageError("--quick and --preset disagree (--preset)")
    preset = args.preset or "quick"
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = MADOptions(
        preset=preset,
        tasks=_resolve_tasks(args.tasks),
        rules=list(dict.fromkeys(args.rules)),
        num_heads=args.num_heads,
        lrs=args.lrs,
        wds=args.wds,
        epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        precision=args.precision,
        device=args.device,
        time_limit=args.time_limit,
        train=not args.report_only,
        settings=args.settings,
        cuda_graph=args.cuda_graph,
        together=args.together,
    )
    _check_settings(opts)
    if args.report_only:
        _check_something_to_report(opts, args.out)
    console.rule(f"[bold]MAD[/bold] ({preset} preset) -> {args.out}")

    provenance = harness.Provenance(command=args.command_line, device=args.device)
    res = run_mad(opts, args.out, progress_factory=harness.progress_factory(), log=console.print)
    res.update(provenance.record("numpy"))
    files = write_outputs(res, args.out, provenance.command)
    console.print(scores_table(aggregate(res["runs"]), preset).rich())
    if res["missing"]:
        console.print(f"[yellow]{len(res['missing'])} planned runs are not stored yet[/yellow] (--report-only?).")
    console.print("Wrote: " + ", ".join(files))
    return 0
