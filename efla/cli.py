"""``efla <command>``: argument parsing and printing only; the work lives in efla.experiments."""

from __future__ import annotations

import argparse
import os
import sys
import time

from rich.console import Console
from rich.table import Table

console = Console()


def _demo_threads(args) -> int:
    from efla.experiments.demo import current_load, threads_for_load  # noqa: PLC0415

    if args.threads:
        return args.threads
    return threads_for_load(os.cpu_count() or 1, current_load())


def cmd_demo(args) -> int:
    import torch  # noqa: PLC0415

    from efla.experiments import arg_checks as check  # noqa: PLC0415
    from efla.experiments.demo import MEASURED_SECONDS, run_demo, side_by_side, write_demo_outputs  # noqa: PLC0415

    check.at_least(args.epochs, 1, "--epochs")
    check.at_least(args.threads, 1, "--threads")
    check.output_dir(args.out)
    t0 = time.perf_counter()
    threads = _demo_threads(args)
    torch.set_num_threads(threads)
    console.rule(f"[bold]EFLA demo[/bold]: exact flow vs Euler (DeltaNet); about {MEASURED_SECONDS} s on an idle "
                 "2-core CPU")
    console.print(f"Using {threads} CPU thread(s) (from the current load; --threads N to choose). Each part's "
                  f"results are written to {args.out} as soon as it ends.")
    console.print(
        "One step of S' = (I - c k k^T) S + c k v^T from the same state, unit key (lambda = 1).\n"
        "Euler (DeltaNet) uses c = beta: its eigenvalue along k is 1 - beta*lambda.\n"
        "EFLA integrates the ODE exactly: c = (1 - exp(-beta*lambda))/lambda, eigenvalue exp(-beta*lambda)."
    )
    res = run_demo(quick=args.quick, progress_factory=_progress_factory(), log=lambda m: console.print(f"[dim]{m}[/dim]"),
                   epochs=args.epochs, timing_shapes=((1, 128, 2, 32),) if args.epochs and args.epochs < 3 else None,
                   mad_epochs=args.epochs if args.epochs and args.epochs < 3 else None,
                   on_part_done=lambda partial: write_demo_outputs(partial, args.out))
    tab = Table(title="(a) One step: exact flow vs Euler")
    for col in ("beta*lambda", "Euler eigenvalue 1-beta*lambda", "EFLA eigenvalue exp(-beta*lambda)",
                "||S_exact - S_euler|| / ||S_0||", "Euler"):
        tab.add_column(col, justify="right")
    for r in res["one_step"]:
        tab.add_row(
            f"{r['beta_lambda']:g}", f"{r['euler_eigenvalue']:+.4f}", f"{r['exact_eigenvalue']:.4f}",
            f"{r['one_step_rel_diff']:.2e}", "[red]expands[/red]" if r["euler_expands"] else "contracts",
        )
    console.print(tab)
    console.print("The difference shrinks as (beta*lambda)^2 for small steps; past beta*lambda = 2 Euler expands.\n")
    tab = Table(title="(b, c) EFLA vs DeltaNet, side by side (small CPU runs, one seed)")
    tab.add_column("metric")
    tab.add_column("EFLA", justify="right")
    tab.add_column("DeltaNet", justify="right")
    for row in side_by_side(res):
        tab.add_row(*row)
    console.print(tab)
    tab = Table(title="(d) CPU time, float32 (median ms)")
    for col in ("[B, T, H, D]", "chunk fwd", "recurrent fwd", "chunk fwd+bwd", "recurrent fwd+bwd"):
        tab.add_column(col, justify="right")
    for r in res["cpu_timings"]:
        tab.add_row(str(r["shape"]), f"{r['chunk_fwd_ms']:.1f}", f"{r['recurrent_fwd_ms']:.1f}",
                    f"{r['chunk_fwd_bwd_ms']:.1f}", f"{r['recurrent_fwd_bwd_ms']:.1f}")
    console.print(tab)
    files = write_demo_outputs(res, args.out)
    console.print(f"Wrote {', '.join(files)} in {time.perf_counter() - t0:.0f} s. Open [bold]"
                  f"{os.path.join(args.out, 'report.md')}[/bold]. This is a small demonstration: the full "
                  "experiments are efla robustness, efla lr-sweep, efla mad, efla train and efla eval.")
    return 0


def _progress_factory():
    from tqdm.auto import tqdm  # noqa: PLC0415

    return lambda total, desc: tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _load_pixels(args):
    from efla.data import load_pixel_data  # noqa: PLC0415

    data = load_pixel_data(args.dataset, args.data_dir)
    how = "found" if args.dataset == "auto" and data.name == "mnist" else "selected"
    if args.dataset == "auto" and data.name == "digits":
        console.print("No MNIST files found: using the embedded 8x8 digits (scikit-learn, no download). "
                      "Pass --data-dir DIR with the MNIST idx(.gz) files for the paper's setting.")
    else:
        console.print(f"Dataset: {data.name} ({how}: {data.source}), sequence length {data.seq_len}, "
                      f"{len(data.x_train)} train / {len(data.x_test)} test.")
    return data


def _robustness_options(args):
    from efla.experiments.robustness_run import RobustnessOptions  # noqa: PLC0415

    quick = args.quick
    train_limit = args.train_limit
    test_limit = args.test_limit
    if quick:
        train_limit = train_limit or 6000
        test_limit = test_limit or 2000
    seeds = args.seeds if args.seeds is not None else [0]
    epochs = args.epochs if args.epochs is not None else (1 if args._data_name == "mnist" else 40)
    return RobustnessOptions(rules=args.rules, lr=args.lr, paper_lr=getattr(args, "paper_lr", False), seeds=seeds,
                             epochs=epochs, batch_size=args.batch_size, width=args.width,
                             num_heads=args.num_heads, quick=quick, train_limit=train_limit, test_limit=test_limit,
                             device=args.device)


def _command_line() -> str:
    return "efla " + " ".join(sys.argv[1:])


def _check_pixel_args(args) -> None:
    from efla.experiments import arg_checks as check  # noqa: PLC0415
    from efla.errors import UsageError  # noqa: PLC0415

    check.at_least(args.epochs, 1, "--epochs")
    check.positive(args.lr, "--lr")
    check.positive(getattr(args, "lrs", None), "--lrs")
    check.at_least(args.batch_size, 1, "--batch-size")
    check.at_least(args.width, 1, "--width")
    check.at_least(args.num_heads, 1, "--num-heads")
    if args.width % args.num_heads:
        raise UsageError(f"--width {args.width} is not a multiple of --num-heads {args.num_heads} (--num-heads)")
    check.at_least(args.train_limit, 1, "--train-limit")
    check.at_least(args.test_limit, 1, "--test-limit")
    check.existing_dir(args.data_dir, "--data-dir")
    check.device(args.device)
    check.output_dir(args.out)


def cmd_robustness(args) -> int:
    from efla.experiments.robustness_run import aggregate, run_robustness, write_robustness_outputs  # noqa: PLC0415
    from efla.experiments.robustness import RULE_LABEL  # noqa: PLC0415

    _check_pixel_args(args)
    data = _load_pixels(args)
    args._data_name = data.name
    opts = _robustness_options(args)
    res = run_robustness(data, opts, progress_factory=_progress_factory())
    files = write_robustness_outputs(res, args.out, args.command_line or _command_line())
    agg = aggregate(res)
    for setting, by_rule in agg.items():
        tab = Table(title=f"{data.name}: accuracy averaged over perturbation levels ({setting})")
        tab.add_column("perturbation")
        for r in by_rule:
            tab.add_column(f"{RULE_LABEL[r]} (lr {by_rule[r]['lr']:g})", justify="right")
        tab.add_row("clean", *[f"{by_rule[r]['clean']['mean']:.4f}" for r in by_rule])
        for kind in res["levels"]:
            tab.add_row(kind, *[f"{by_rule[r][kind]['area']:.4f}" for r in by_rule])
        console.print(tab)
    console.print("Wrote: " + ", ".join(files))
    return 0


def cmd_lr_sweep(args) -> int:
    from efla.experiments.robustness_run import run_lr_sweep, write_lr_sweep_outputs  # noqa: PLC0415
    from efla.experiments.robustness import RULE_LABEL  # noqa: PLC0415

    _check_pixel_args(args)
    data = _load_pixels(args)
    args._data_name = data.name
    opts = _robustness_options(args)
    lrs = args.lrs
    if args.quick and not args.lrs_given:
        lrs = [1e-3, 1e-2]
    res = run_lr_sweep(data, opts, lrs=lrs, progress_factory=_progress_factory())
    files = write_lr_sweep_outputs(res, args.out, args.command_line or _command_line())
    tab = Table(title=f"{data.name}: learning-rate sweep (final train loss / test accuracy)")
    tab.add_column("rule")
    for lr in res["lrs"]:
        tab.add_column(f"lr {lr:g}", justify="right")
    for rule in opts.rules:
        cells = []
        for lr in res["lrs"]:
            rows = [r for r in res["rows"] if r["rule"] == rule and r["lr"] == lr]
            cells.append(f"{sum(r['final_train_loss'] for r in rows) / len(rows):.3f} / "
                         f"{sum(r['test_accuracy'] for r in rows) / len(rows):.4f}")
        tab.add_row(RULE_LABEL[rule], *cells)
    console.print(tab)
    console.print("Wrote: " + ", ".join(files))
    return 0


def _add_pixel_args(p, default_out):
    p.add_argument("--quick", action="store_true", help="a subset of the data (6000 train / 2000 test) and fewer settings")
    p.add_argument("--out", default=default_out, help=f"output directory (default: {default_out})")
    p.add_argument("--dataset", default="auto", choices=["auto", "mnist", "digits"],
                   help="auto: MNIST if found (--data-dir, $EFLA_MNIST_DIR or ../shared/data/mnist), else embedded digits")
    p.add_argument("--data-dir", default=None, help="folder with the four MNIST idx(.gz) files (or MNIST/raw)")
    p.add_argument("--rules", nargs="+", default=["exact", "euler"],
                   choices=["exact", "euler", "gated-exact", "gated-euler"], help="update rules to compare")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate used for every rule (default 1e-3)")
    p.add_argument("--epochs", type=int, default=None,
                   help="training epochs (default: 1 on MNIST as in the paper, 40 on the small embedded digits)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default: 0)")
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training examples")
    p.add_argument("--test-limit", type=int, default=None, help="use only the first N test examples")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--command-line", default=None, help=argparse.SUPPRESS)


def _cuda_available() -> bool:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    except Exception:
        return False


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a command-line mistake in one line, ``efla <command>: <what> (see ... --help)``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="efla", description="Exact Flow Linear Attention: ops, models and experiments.",
                           epilog="Errors are reported in one line; EFLA_DEBUG=1 or --debug shows the traceback.")
    sub = p.add_subparsers(dest="command", required=True)
    from efla.experiments.demo import MEASURED_SECONDS  # noqa: PLC0415

    d = sub.add_parser("demo", help=f"a CPU tour (about {MEASURED_SECONDS} s on an idle 2-core CPU): exact vs Euler, "
                                    "robustness on embedded digits, MAD, timings",
                       description=f"A CPU tour, about {MEASURED_SECONDS} s on an idle 2-core CPU (longer on a busy "
                                   "machine: it uses the cores the load average leaves free and shows the time left). "
                                   "Each part's results are written to --out as soon as that part ends.")
    d.add_argument("--out", default="efla-demo", help="output directory (default: ./efla-demo)")
    d.add_argument("--quick", action="store_true", help="fewer training epochs and smaller timing shapes")
    d.add_argument("--epochs", type=int, default=None, help="training epochs of the digit classifiers (default 30, quick 12)")
    d.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores the 1-minute load average leaves free, at least 1)")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("robustness", help="pixel-sequence classification under intensity scaling, noise and dropout")
    _add_pixel_args(r, "results/robustness")
    r.add_argument("--paper-lr", action="store_true", help="also train with the authors' lrs (EFLA 3e-3, DeltaNet 1e-3)")
    r.set_defaults(func=cmd_robustness)

    s = sub.add_parser("lr-sweep", help="final training loss and test accuracy across learning rates")
    _add_pixel_args(s, "results/lr-sweep")
    s.add_argument("--lrs", type=float, nargs="+", default=None, help="default: 1e-4 3e-4 1e-3 3e-3 1e-2")
    s.set_defaults(func=cmd_lr_sweep)

    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    import efla.commands  # noqa: PLC0415

    for mod in sorted(m.name for m in pkgutil.iter_modules(efla.commands.__path__)):
        importlib.import_module(f"efla.commands.{mod}").add_parser(sub)
    return p


def _add_debug_option(parser) -> None:
    for sub in _subparsers(parser):
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the full traceback of an error (same as EFLA_DEBUG=1)")


def _subparsers(parser) -> list:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices.values()) if actions else []


def _debug_wanted(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("EFLA_DEBUG", "") not in ("", "0")


_USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)  # UsageError is a ValueError
_RUN_FAILURES = (OSError, RuntimeError, ImportError, EOFError)


def exit_status_and_message(error: BaseException) -> tuple[int, str]:
    """Exit status (2: the command cannot run as given, 1: the work failed) and the one-line message.
    A damaged checkpoint counts as a wrong input (2): the run did not start."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, _USAGE_ERRORS) or type(error).__name__ == "CheckpointError":
        return 2, text
    if isinstance(error, _RUN_FAILURES):
        return 1, text
    return 1, f"{type(error).__name__}: {text} (an unexpected error; EFLA_DEBUG=1 or --debug shows the traceback)"


def main(argv=None) -> int:
    parser = build_parser()
    _add_debug_option(parser)
    args = parser.parse_args(argv)
    if args.command == "lr-sweep":
        args.lrs_given = args.lrs is not None
        if args.lrs is None:
            args.lrs = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _debug_wanted(args):
            raise
        print(f"efla {args.command}: interrupted; what was finished is kept", file=sys.stderr)
        return 130
    except Exception as error:  # every error ends as one line unless a traceback is asked for
        if _debug_wanted(args):
            raise
        status, message = exit_status_and_message(error)
        print(f"efla {args.command}: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
