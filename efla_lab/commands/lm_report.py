"""``efla lm-report``: the losses, loss curves and a summary table of several ``efla train`` runs (the
work is in :mod:`efla_lab.lm.report`)."""

from __future__ import annotations

import pathlib


def add_parser(subparsers) -> None:
    r = subparsers.add_parser(
        "lm-report",
        help="losses JSON/CSV, loss-curve PNG and summary.md of `efla train` runs",
        description="Read finished `efla train` run directories (or a record's runs.jsonl) "
        "and write their losses "
        "(lm_losses.json/.csv), the loss curves (lm_loss_curves.png) and a summary "
        "table per variant (summary.md).",
    )
    r.add_argument(
        "--runs",
        nargs="+",
        required=True,
        help="run directories (OUT of efla train), or a recorded experiment's runs.jsonl (a run per line)",
    )
    r.add_argument("--out", required=True, help="where to write lm_losses.json/.csv, lm_loss_curves.png, summary.md")
    r.add_argument("--title", default="Language modelling", help="heading of summary.md (default: %(default)s)")
    r.add_argument("--notes", default=None, help="a markdown file appended to summary.md (commands, remarks)")
    r.set_defaults(func=cmd_lm_report)


def cmd_lm_report(args) -> int:
    from efla import arg_checks as check
    from efla_lab.lm.report import write_lm_report

    for run in args.runs:
        if run.endswith(".jsonl"):
            check.existing_file(run, "--runs")
        else:
            check.existing_dir(run, "--runs")
    check.existing_file(args.notes, "--notes")
    check.output_dir(args.out)
    notes = pathlib.Path(args.notes).read_text() if args.notes else ""
    files = write_lm_report(args.runs, args.out, title=args.title, notes=notes, command_line=args.command_line)
    print("Wrote: " + ", ".join(files))
    return 0
