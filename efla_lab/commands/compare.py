"""``efla compare``: several models evaluated as ``efla eval`` does, in one Markdown table in the
paper's Table 1 layout (the work is in :mod:`efla_lab.lm.compare`)."""

from __future__ import annotations

import json
import os

from efla.commands.eval import add_eval_options, eval_options, print_record, setup_threads
from efla.errors import UsageError
from efla.records import progress_factory


def cmd_compare(args) -> int:
    from efla.evaluation import check_model_dir, evaluate_model, write_json, write_text
    from efla_lab.lm.compare import compare

    setup_threads(args)
    sources = list(args.models or []) + list(args.models_opt or [])
    if not sources:
        raise UsageError("give model directories or eval.json files (MODELS)")
    recorded = {src: _recorded_evaluations(src) for src in sources if src.endswith(".json") and os.path.isfile(src)}
    for src in sources:
        if src not in recorded:
            check_model_dir(src, "MODELS")
    records = []
    opts = None
    for src in sources:
        if src in recorded:
            recs = recorded[src]
            records.extend(recs)
            print(f"{src}: using {len(recs)} recorded evaluation(s)")
            continue
        opts = opts or eval_options(args)
        name = os.path.basename(os.path.normpath(src))
        cached = os.path.join(args.out, "models", name, "eval.json")
        if args.reuse and os.path.isfile(cached):
            with open(cached) as f:
                rec = json.load(f)
            print(f"{src}: reusing {cached}")
        else:
            print(f"Evaluating {src} ...")
            rec = evaluate_model(src, opts, progress_factory=progress_factory())
            rec["command"] = args.command_line
            write_json(cached, rec)
        print_record(rec)
        records.append(rec)
    md, summary = compare(records)
    cmd = args.command_line
    md = f"# Language-model evaluation\n\nCommand: `{cmd}`\n\n" + md
    write_text(os.path.join(args.out, "table.md"), md)
    write_json(os.path.join(args.out, "eval.json"), dict(summary, command=cmd, records=records))
    print(md)
    print(f"Wrote {os.path.join(args.out, 'table.md')} and {os.path.join(args.out, 'eval.json')}")
    return 0


def _recorded_evaluations(path: str) -> list[dict]:
    """The evaluations in an ``eval.json`` of ``efla eval`` (one model) or of an earlier ``efla compare``
    (its ``records``), read before any model is evaluated."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path}: not a readable eval.json ({' '.join(str(error).split())}) (MODELS)") from None
    recs = obj.get("records", [obj]) if isinstance(obj, dict) else None
    if not isinstance(recs, list) or not all(isinstance(r, dict) and "model" in r for r in recs):
        raise UsageError(f"{path}: not an eval.json of efla eval or efla compare (no 'model' record) (MODELS)")
    return recs


def add_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="evaluate several models; one Markdown table in the paper's Table 1 layout",
        description="Evaluate model directories (or read eval.json files) and write table.md and "
        "eval.json: per-variant mean and spread over seeds, per-model rows, "
        "EFLA-vs-DeltaNet differences, and the paper's Table 1 for reference.",
    )
    c.add_argument("models", nargs="*", help="model directories or eval.json files")
    c.add_argument("--models", dest="models_opt", nargs="+", default=None, help="same as the positional arguments")
    c.add_argument("--out", default=os.path.join("results", "compare"), help="output directory")
    c.add_argument("--reuse", action="store_true", help="reuse <out>/models/<name>/eval.json when present")
    add_eval_options(c)
    c.set_defaults(func=cmd_compare)
