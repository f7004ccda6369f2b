"""``efla robustness`` and ``efla lr-sweep``: pixel-sequence classification, EFLA vs DeltaNet."""

from __future__ import annotations

from efla.errors import UsageError
from efla import arg_checks as check
from efla_lab.harness import default_device


def add_parser(subparsers) -> None:
    r = subparsers.add_parser(
        "robustness",
        help="pixel-sequence classification under intensity scaling, noise and dropout",
        description="Train EFLA and DeltaNet pixel-sequence classifiers (MNIST, or the embedded 8x8 digits) and test "
        "them under input intensity scaling, additive noise and dropout. Writes results.json, one CSV "
        "per learning-rate setting, plots and summary.md.",
    )
    _add_pixel_args(r, "results/robustness")
    r.add_argument("--lr", type=float, default=1e-3, help="learning rate used for every rule (default 1e-3)")
    r.add_argument("--paper-lr", action="store_true", help="also train with the authors' lrs (EFLA 3e-3, DeltaNet 1e-3)")
    r.set_defaults(func=cmd_robustness)

    s = subparsers.add_parser(
        "lr-sweep",
        help="final training loss and test accuracy across learning rates",
        description="Train EFLA and DeltaNet pixel-sequence classifiers at each learning rate of --lrs and report "
        "the final training loss and the test accuracy per rule and learning rate. Writes lr_sweep.json, "
        "lr_sweep.csv, lr_sweep.png and lr_sweep.md.",
    )
    _add_pixel_args(s, "results/lr-sweep")
    s.add_argument("--lrs", type=float, nargs="+", default=None, help="default: 1e-4 3e-4 1e-3 3e-3 1e-2")
    s.set_defaults(func=cmd_lr_sweep)


def _add_pixel_args(p, default_out):
    p.add_argument("--quick", action="store_true", help="a subset of the data (6000 train / 2000 test) and fewer settings")
    p.add_argument("--out", default=default_out, help=f"output directory (default: {default_out})")
    p.add_argument(
        "--dataset",
        default="auto",
        choices=["auto", "mnist", "digits"],
        help="auto: MNIST if found (--data-dir, or mnist/ under $EFLA_DATA_DIR or ../shared/data), else embedded digits",
    )
    p.add_argument("--data-dir", default=None, help="folder with the four MNIST idx(.gz) files (or MNIST/raw)")
    p.add_argument(
        "--rules",
        nargs="+",
        default=["exact", "euler"],
        choices=["exact", "euler", "gated-exact", "gated-euler"],
        help="update rules to compare",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="training epochs (default: 1 on MNIST as in the paper, 40 on the small embedded digits)",
    )
    p.add_argument("--batch-size", type=int, default=128, help="training examples per step (default 128)")
    p.add_argument(
        "--width", type=int, default=64, help="model width: pixel embedding and q/k/v size, split over --num-heads (default 64)"
    )
    p.add_argument("--num-heads", type=int, default=1, help="attention heads; must divide --width (default 1)")
    p.add_argument(
        "--authors-model",
        action="store_true",
        help="the authors' model: no bias on the pixel projection, xavier-uniform q/k/v weights",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default: 0)")
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N training examples")
    p.add_argument("--test-limit", type=int, default=None, help="use only the first N test examples")
    p.add_argument("--device", default=default_device(), help="cpu, cuda or cuda:N (default: cuda if available)")


def _check_pixel_args(args) -> None:
    check.at_least(args.epochs, 1, "--epochs")
    check.positive(getattr(args, "lr", None), "--lr")
    check.positive(getattr(args, "lrs", None), "--lrs")
    check.at_least(args.batch_size, 1, "--batch-size")
    check.at_least(args.width, 1, "--width")
    check.at_least(args.num_heads, 1, "--num-heads")
    if args.width % args.num_heads:
        raise UsageError(f"--width {args.width} is not a multiple of --num-heads {args.num_heads} (--num-heads)")
    check.at_least(args.train_limit, 1, "--train-limit")
    check.at_least(args.test_limit, 1, "--test-limit")
    check.existing_dir(args.data_dir, "--data-dir")
    if args.dataset == "digits":
        check.not_ignored(args, {"data_dir": "--data-dir"}, "with --dataset digits, which are embedded")
    check.device(args.device)
    check.output_dir(args.out)


def _load_pixels(args, console):
    from efla_lab.data.pixels import load_pixel_data

    data = load_pixel_data(args.dataset, args.data_dir)
    how = "found" if args.dataset == "auto" and data.name == "mnist" else "selected"
    if args.dataset == "auto" and data.name == "digits":
        console.print(
            "No MNIST files found: using the embedded 8x8 digits (scikit-learn, no download). "
            "Pass --data-dir DIR with the MNIST idx(.gz) files for the paper's setting."
        )
    else:
        console.print(
            f"Dataset: {data.name} ({how}: {data.source}), sequence length {data.seq_len}, "
            f"{len(data.x_train)} train / {len(data.x_test)} test."
        )
    return data


def _prepare(args):
    """Checks the arguments, loads the data and resolves the options: (console, data, options)."""
    from rich.console import Console

    from efla_lab.robustness.run import RobustnessOptions

    _check_pixel_args(args)
    console = Console()
    data = _load_pixels(args, console)
    opts = RobustnessOptions.for_data(
        data.name,
        quick=args.quick,
        epochs=args.epochs,
        seeds=args.seeds,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        rules=args.rules,
        lr=getattr(args, "lr", RobustnessOptions.lr),
        paper_lr=getattr(args, "paper_lr", False),
        batch_size=args.batch_size,
        width=args.width,
        num_heads=args.num_heads,
        authors_model=args.authors_model,
        device=args.device,
    )
    return console, data, opts


def cmd_robustness(args) -> int:
    from efla_lab import harness
    from efla_lab.robustness.report import aggregate, robustness_tables, write_robustness_outputs
    from efla_lab.robustness.run import run_robustness

    provenance = harness.Provenance(command=args.command_line, device=args.device)
    console, data, opts = _prepare(args)
    res = run_robustness(data, opts, progress_factory=harness.progress_factory())
    res.update(provenance.record("transformers"))
    files = write_robustness_outputs(res, args.out, provenance.command)
    for table in robustness_tables(res, aggregate(res)).values():
        console.print(table.rich())
    console.print("Wrote: " + ", ".join(files))
    return 0


def cmd_lr_sweep(args) -> int:
    from efla_lab import harness
    from efla_lab.robustness.report import lr_sweep_table, write_lr_sweep_outputs
    from efla_lab.robustness.run import run_lr_sweep, sweep_lrs

    provenance = harness.Provenance(command=args.command_line, device=args.device)
    console, data, opts = _prepare(args)
    res = run_lr_sweep(data, opts, lrs=sweep_lrs(args.lrs, args.quick), progress_factory=harness.progress_factory())
    res.update(provenance.record("transformers"))
    files = write_lr_sweep_outputs(res, args.out, provenance.command)
    console.print(lr_sweep_table(res).rich())
    console.print("Wrote: " + ", ".join(files))
    return 0
