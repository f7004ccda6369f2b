"""``efla eval``: one model's WikiText perplexity, LAMBADA and lm-evaluation-harness tasks. Argument
parsing and printing only; the work is in :mod:`efla.evaluation`. The lab's ``efla compare`` reuses
its options and printing."""

from __future__ import annotations

import os

from efla.errors import UsageError
from efla.records import progress_factory


def eval_options(args):
    from efla.data.eval_text import default_data_file
    from efla.evaluation import EvalOptions

    wikitext, lambada = args.wikitext, args.lambada
    harness = [t.strip() for t in args.harness.split(",") if t.strip()] if args.harness else None
    if wikitext is None and lambada is None and not harness:
        wikitext, lambada = default_data_file("wikitext"), default_data_file("lambada")
        if wikitext is None and lambada is None:
            raise UsageError(
                "nothing to evaluate: no default data found under $EFLA_DATA_DIR or ../shared/data "
                "(--wikitext FILE, --lambada FILE or --harness TASKS)"
            )
        print(f"No data given: using wikitext={wikitext}, lambada={lambada}")
    if wikitext and wikitext.lower() == "none":
        wikitext = None
    if lambada and lambada.lower() == "none":
        lambada = None
    _check_eval_options(args, wikitext, lambada, harness)
    return EvalOptions(
        wikitext=wikitext,
        lambada=lambada,
        context=args.context,
        stride=args.stride,
        batch_size=args.batch_size,
        limit=args.limit,
        wikitext_max_tokens=args.wikitext_max_tokens,
        prefix=args.prefix,
        device=args.device,
        dtype=args.dtype,
        harness=harness,
        harness_include=args.harness_include,
        harness_limit=args.harness_limit,
        num_fewshot=args.num_fewshot,
    )


def _check_eval_options(args, wikitext: str | None, lambada: str | None, harness: list[str] | None) -> None:
    from efla.data.eval_text import load_lambada, load_text
    from efla.evaluation import check_harness_tasks
    from efla import arg_checks as check

    check.at_least(args.context, 2, "--context")
    check.at_least(args.stride, 1, "--stride")
    check.at_least(args.batch_size, 1, "--batch-size")
    check.at_least(args.limit, 1, "--limit")
    check.at_least(args.wikitext_max_tokens, 1, "--wikitext-max-tokens")
    check.at_least(args.threads, 1, "--threads")
    check.at_least(args.harness_limit, 1, "--harness-limit")
    check.at_least(args.num_fewshot, 0, "--num-fewshot")
    check.device(args.device)
    _check_something_to_do(args, wikitext, lambada, harness)
    check.existing_file(lambada, "--lambada")
    if lambada:
        load_lambada(lambada, args.limit)
    if wikitext and (
        os.path.exists(wikitext) or wikitext.startswith((".", "/", "~")) or wikitext.endswith((".raw", ".txt", ".jsonl"))
    ):  # a local file, not a datasets name
        check.existing_file(wikitext, "--wikitext")
        load_text(wikitext)
    if args.out:
        check.output_dir(args.out, "--out")
    if harness:
        check.existing_dir(args.harness_include, "--harness-include")
        check_harness_tasks(harness, args.harness_include, lambada)


def _check_something_to_do(args, wikitext: str | None, lambada: str | None, harness: list[str] | None) -> None:
    """Some benchmark to run, and no option given for one that does not run."""
    from efla import arg_checks as check

    if wikitext is None and lambada is None and not harness:
        raise UsageError(
            "nothing to evaluate: --wikitext and --lambada are 'none' and no --harness tasks (--wikitext, --lambada)"
        )
    if wikitext is None:
        check.not_ignored(
            args,
            {"stride": "--stride", "wikitext_max_tokens": "--wikitext-max-tokens", "prefix": "--prefix"},
            "with --wikitext none",
        )
    if lambada is None and not harness:
        check.not_ignored(args, {"limit": "--limit"}, "without LAMBADA or --harness tasks")
    if not harness:
        check.not_ignored(
            args,
            {"harness_include": "--harness-include", "harness_limit": "--harness-limit", "num_fewshot": "--num-fewshot"},
            "without --harness tasks",
        )


def setup_threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


class _TextTable:
    """Rows of cells printed in aligned columns (``right``: the columns aligned right)."""

    def __init__(self, columns: list[str], right: set[int]):
        self.rows = [columns]
        self.right = right

    def add_row(self, *cells: str) -> None:
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(row[i]) for row in self.rows) for i in range(len(self.rows[0]))]
        cell = lambda i, c: c.rjust(widths[i]) if i in self.right else c.ljust(widths[i])  # noqa: E731
        lines = ["  ".join(cell(i, c) for i, c in enumerate(row)).rstrip() for row in self.rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def print_record(rec: dict) -> None:
    """One model's evaluation as a plain-text table on standard output."""
    m = rec["model"]
    title = f"{m['name']}: {m['label']} ({m['parameters'] / 1e6:.2f}M parameters" + (
        f", seed {m['seed']})" if m["seed"] is not None else ")"
    )
    tab = _TextTable(["benchmark", "metric", "value", "details"], right={2})
    if "wikitext" in rec:
        w = rec["wikitext"]
        det = (
            f"{w['scored_tokens']} tokens, {w['words']} words, {w['bytes']} bytes; context {w['context']}, "
            f"stride {w['stride']}, {w['windows']} windows"
        )
        tab.add_row("WikiText", "word perplexity ↓", f"{w['word_perplexity']:.3f}", det)
        tab.add_row("", "token perplexity ↓", f"{w['token_perplexity']:.3f}", "")
        tab.add_row("", "bits per byte ↓", f"{w['bits_per_byte']:.4f}", "")
    if "lambada" in rec:
        lam = rec["lambada"]
        det = f"{lam['n']} of {lam['passages_in_file']} passages" + (" (--limit)" if lam["limit"] else "")
        tab.add_row("LAMBADA (OpenAI)", "accuracy ↑", f"{100 * lam['accuracy']:.2f}% ± {100 * lam['accuracy_stderr']:.2f}", det)
        tab.add_row("", "last-word perplexity ↓", f"{lam['perplexity']:.3f}", "")
    for task, vals in rec.get("harness", {}).items():
        for k, v in vals.items():
            if not k.endswith("_stderr"):
                tab.add_row(f"lm-eval {task}", k, f"{v:.4f}", "")
    print(title)
    print(tab.text())


def cmd_eval(args) -> int:
    from efla.evaluation import check_model_dir, evaluate_model, write_json

    check_model_dir(args.model)
    setup_threads(args)
    opts = eval_options(args)
    out = args.out or os.path.join("results", "eval", os.path.basename(os.path.normpath(args.model)))
    rec = evaluate_model(args.model, opts, progress_factory=progress_factory())
    rec["command"] = args.command_line
    print_record(rec)
    path = os.path.join(out, "eval.json")
    write_json(path, rec)
    print(f"Wrote {path} ({rec['seconds']:.1f} s)")
    return 0


def add_eval_options(p) -> None:
    p.add_argument(
        "--wikitext",
        default=None,
        help="raw WikiText file (e.g. wiki.test.raw), or a datasets name when online (NAME[:CONFIG[:SPLIT]]); 'none' skips it",
    )
    p.add_argument(
        "--lambada",
        default=None,
        help="OpenAI LAMBADA JSONL (lambada_test.jsonl); 'none' skips it. "
        "With neither given, both are looked up under $EFLA_DATA_DIR or ../shared/data",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per forward (WikiText window, LAMBADA truncation); default: the model's "
        "max_position_embeddings, at most 2048",
    )
    p.add_argument(
        "--stride", type=int, default=None, help="WikiText: new tokens scored per window (< context); default context/2"
    )
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward (LAMBADA uses twice as many)")
    p.add_argument("--limit", type=int, default=None, help="LAMBADA: evaluate only the first N passages")
    p.add_argument("--wikitext-max-tokens", type=int, default=None, help="WikiText: only the first N tokens (a quick check)")
    p.add_argument(
        "--prefix",
        default="auto",
        choices=["auto", "bos", "eos", "none"],
        help="token before the WikiText stream so its first token is scored (auto: BOS if the "
        "tokenizer adds BOS itself, else EOS, the document separator of `efla train`)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the model is evaluated in (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--harness",
        default=None,
        metavar="TASKS",
        help="comma-separated lm-evaluation-harness tasks (needs lm-eval: pip install 'efla[eval]'); "
        "'lambada_openai_local' runs lambada_openai over --lambada FILE offline",
    )
    p.add_argument("--harness-include", default=None, metavar="DIR", help="folder of extra lm-eval task YAMLs")
    p.add_argument("--harness-limit", type=int, default=None, help="lm-eval: examples per task (default: --limit)")
    p.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: few-shot examples")


def add_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="WikiText perplexity, LAMBADA accuracy/perplexity (and lm-eval tasks) of a model",
        description="Evaluate a saved model directory: WikiText token/word perplexity and bits per byte "
        "(sliding window), LAMBADA last-word accuracy and perplexity (lm-eval's "
        "lambada_openai definition), optionally lm-evaluation-harness tasks. Writes eval.json.",
    )
    e.add_argument("--model", required=True, help="model directory (config, weights and tokenizer)")
    e.add_argument("--out", default=None, help="output directory (default: results/eval/<model dir name>)")
    add_eval_options(e)
    e.set_defaults(func=cmd_eval)
