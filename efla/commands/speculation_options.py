"""The speculative-decoding options that ``efla generate`` and ``efla serve`` share: adding them,
their checks before anything loads, and the ``speculate`` setting they make (the draft model loaded
and compared with the model)."""

from __future__ import annotations

from efla.commands.saved_model import check_model_dir, load_model
from efla.errors import UsageError


def add_speculation_options(parser) -> None:
    parser.add_argument(
        "--speculate",
        default=None,
        metavar="METHOD",
        help="speculative decoding: ngram (prompt lookup: drafts copied from the prompt and text so far) or "
        "draft_model (a smaller efla model with the same tokenizer, --draft-model); greedy output is unchanged, "
        "sampled output keeps its distribution",
    )
    parser.add_argument(
        "--draft-model", default=None, metavar="DIR", help="the draft model's directory (--speculate draft_model)"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="draft tokens checked per model pass at most (default: 4; fewer where drafts are rejected)",
    )
    parser.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=None,
        metavar="N",
        help="longest n-gram that prompt lookup matches (default: 3)",
    )


def check_speculation(args) -> None:
    from efla import arg_checks as check

    if args.speculate not in (None, "ngram", "draft_model"):
        raise UsageError(f"expected ngram or draft_model, got {args.speculate!r} (--speculate)")
    check.at_least(args.num_speculative_tokens, 1, "--num-speculative-tokens")
    check.at_least(args.prompt_lookup_max, 1, "--prompt-lookup-max")
    if args.speculate == "draft_model" and args.draft_model is None:
        raise UsageError("--speculate draft_model needs a draft model directory (--draft-model)")
    if args.draft_model is not None and args.speculate != "draft_model":
        raise UsageError("a draft model is only used with --speculate draft_model (--draft-model)")
    for value, option in (
        (args.num_speculative_tokens, "--num-speculative-tokens"),
        (args.prompt_lookup_max, "--prompt-lookup-max"),
    ):
        if value is not None and args.speculate is None:
            raise UsageError(f"a speculative setting without --speculate ({option})")
    if args.prompt_lookup_max is not None and args.speculate != "ngram":
        raise UsageError("prompt lookup's setting is only used with --speculate ngram (--prompt-lookup-max)")
    if args.draft_model is not None:
        check_model_dir(args.draft_model, "--draft-model")


def speculation(args, model, tokenizer, device, dtype) -> dict | None:
    """The ``speculate`` setting of the options (``None``: off), the draft model loaded and checked."""
    if args.speculate is None:
        return None
    settings = {"method": args.speculate, "num_speculative_tokens": args.num_speculative_tokens or 4}
    if args.speculate == "ngram":
        return {**settings, "prompt_lookup_max": args.prompt_lookup_max or 3}
    draft, draft_tokenizer = load_model(args.draft_model, device, dtype)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UsageError(f"{args.draft_model}: its tokenizer differs from the model's (--draft-model)")
    if draft.get_output_embeddings().out_features != model.get_output_embeddings().out_features:
        raise UsageError(f"{args.draft_model}: its vocabulary size differs from the model's (--draft-model)")
    return {**settings, "model": draft}
