"""``efla demo``: a CPU tour of exact flow vs Euler; prints the tables the report holds."""

from __future__ import annotations

import os
import time

from efla import arg_checks as check


def add_parser(subparsers) -> None:
    from efla_lab.demo import MEASURED_SECONDS

    p = subparsers.add_parser(
        "demo",
        help=f"a CPU tour (about {MEASURED_SECONDS} s on an idle 2-core CPU): exact vs Euler, "
        "robustness on embedded digits, MAD, timings",
        description=f"A CPU tour, about {MEASURED_SECONDS} s on an idle 2-core CPU (longer on a busy "
        "machine: it uses the cores the load average leaves free and shows the time left). "
        "Each part's results are written to --out as soon as that part ends.",
    )
    p.add_argument("--out", default="efla-demo", help="output directory (default: ./efla-demo)")
    p.add_argument("--quick", action="store_true", help="fewer training epochs and smaller timing shapes")
    p.add_argument("--epochs", type=int, default=None, help="training epochs of the digit classifiers (default 30, quick 12)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the cores the 1-minute load average leaves free, at least 1)",
    )
    p.set_defaults(func=cmd_demo)


def _threads(args) -> int:
    from efla_lab.demo import current_load, threads_for_load

    if args.threads:
        return args.threads
    return threads_for_load(os.cpu_count() or 1, current_load())


def cmd_demo(args) -> int:
    import torch
    from rich.console import Console

    from efla_lab import demo, harness

    check.at_least(args.epochs, 1, "--epochs")
    check.at_least(args.threads, 1, "--threads")
    check.output_dir(args.out)
    console = Console()
    t0 = time.perf_counter()
    threads = _threads(args)
    torch.set_num_threads(threads)
    console.rule(f"[bold]EFLA demo[/bold]: exact flow vs Euler (DeltaNet); about {demo.MEASURED_SECONDS} s on an idle 2-core CPU")
    console.print(
        f"Using {threads} CPU thread(s) (from the current load; --threads N to choose). Each part's "
        f"results are written to {args.out} as soon as it ends."
    )
    console.print(
        "One step of S' = (I - c k k^T) S + c k v^T from the same state, unit key (lambda = 1).\n"
        "Euler (DeltaNet) uses c = beta: its eigenvalue along k is 1 - beta*lambda.\n"
        "EFLA integrates the ODE exactly: c = (1 - exp(-beta*lambda))/lambda, eigenvalue exp(-beta*lambda)."
    )
    res = demo.run_demo(
        quick=args.quick,
        progress_factory=harness.progress_factory(),
        log=lambda m: console.print(f"[dim]{m}[/dim]"),
        epochs=args.epochs,
        on_part_done=lambda partial: demo.write_demo_outputs(partial, args.out),
    )
    one_step, *others = demo.demo_tables(res)
    console.print(one_step.rich())
    console.print("The difference shrinks as (beta*lambda)^2 for small steps; past beta*lambda = 2 Euler expands.\n")
    for table in others:
        console.print(table.rich())
    files = demo.write_demo_outputs(res, args.out)
    console.print(
        f"Wrote {', '.join(files)} in {time.perf_counter() - t0:.0f} s. Open [bold]"
        f"{os.path.join(args.out, 'report.md')}[/bold]. This is a small demonstration: the full "
        "experiments are efla robustness, efla lr-sweep, efla mad, efla train and efla eval."
    )
    return 0
