"""``efla train``: language-model training (the work is in :mod:`efla.training.trainer`)."""

from __future__ import annotations

import argparse
import sys

_EPILOG = """\
examples:
  efla train --preset tiny-efla --data ../shared/data/corpus/gutenberg --max-steps 500 --out runs/lm/efla-s0
  efla train --preset tiny-efla --data ../shared/data/corpus/gutenberg --max-steps 500 --out runs/lm/efla-s0 --resume
  efla train --out runs/lm/efla-s0 --resume --max-steps 800 --extend-at-min-lr   # 300 more steps at --min-lr
  torchrun --nproc_per_node 2 -m efla train --preset tiny-deltanet --data corpus/ --max-steps 100 --out runs/ddp
  torchrun --nproc_per_node 2 -m efla train --preset tiny-efla --data corpus/ --seq-len 4096 --context-parallel 2 --out runs/cp
The output directory is a Hugging Face model directory (config.json, model.safetensors, tokenizer):
  import efla; AutoModelForCausalLM.from_pretrained(out); AutoTokenizer.from_pretrained(out)
"""


def add_parser(subparsers) -> None:
    from efla.training.config import TrainConfig

    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a language model (EFLA / DeltaNet / gated variants) on text files",
        description="Train a causal LM with the paper's recipe (AdamW, peak lr 3e-4, warm-up and cosine from/to "
        "3e-5, weight decay 0.1, clip 1.0). Works under torchrun (DDP; --fsdp for FSDP2).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--preset",
        default=d.preset,
        metavar="NAME",
        help="tiny|340m|1.3b x efla|gated-efla|deltanet|gated-deltanet, e.g. tiny-efla, or tiny-hybrid-efla "
        "(one softmax-attention layer) (default: %(default)s)",
    )
    g.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="JSON",
        help="an EFLAConfig JSON file instead of --preset (vocab_size is set from the tokenizer)",
    )
    g.add_argument("--grad-checkpointing", action="store_true", help="activation checkpointing per block")
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        nargs="+",
        default=None,
        metavar="PATH",
        help="text/JSONL files or directories (hf:NAME[:CONFIG][@SPLIT] for a Hugging Face dataset); required unless resuming",
    )
    g.add_argument(
        "--val-data",
        nargs="+",
        default=None,
        metavar="PATH",
        help="held-out files for the validation loss (default: --val-sequences held out of --data)",
    )
    g.add_argument(
        "--val-sequences", type=int, default=d.val_sequences, help="sequences for the validation loss (default: %(default)s)"
    )
    g.add_argument("--text-field", default=d.text_field, help="JSONL field with the text (default: %(default)s)")
    g.add_argument(
        "--accept-invalid-utf8",
        action="store_true",
        help="read bytes that are not UTF-8 as U+FFFD (each such file is reported); default: refuse them",
    )
    g.add_argument(
        "--no-gutenberg-strip",
        dest="gutenberg_strip",
        action="store_false",
        help="keep Project Gutenberg headers/licences (stripped by default when present)",
    )
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 256 tiny, 2048 others)")
    g.add_argument("--varlen", action="store_true", help="pack sequences into one row with cu_seqlens at documents")
    g.add_argument("--data-seed", type=int, default=d.data_seed, help="data order seed (default: %(default)s)")
    g.add_argument("--cache-dir", default=None, help="tokenized-data cache (default: OUT/cache)")
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME_OR_PATH",
        help="a Hugging Face tokenizer (name or directory); default: train a byte-level BPE on --data",
    )
    g.add_argument("--vocab-size", type=int, default=d.vocab_size, help="trained BPE vocabulary (default: %(default)s)")
    g.add_argument(
        "--tokenizer-train-chars",
        type=int,
        default=d.tokenizer_train_chars,
        help="characters of --data to train the BPE on (default: %(default)s)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=None, metavar="N", help="optimizer updates")
    g.add_argument("--max-tokens", type=int, default=None, help="or: training tokens (max steps = this / batch)")
    g.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="global batch in tokens (default: 4096 tiny, 1M (2^20) others, as in the paper)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per forward and rank; the rest is gradient accumulation (default: all)",
    )
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    g.add_argument("--min-lr", type=float, default=d.min_lr, help="start and end learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: max steps / 8")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="default: %(default)s")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="default: %(default)s")
    g.add_argument("--seed", type=int, default=d.seed, help="model initialisation seed (default: %(default)s)")
    g.add_argument(
        "--on-nonfinite",
        choices=["stop", "skip"],
        default=d.on_nonfinite,
        help="non-finite loss: stop (keep the last good checkpoint) or skip the batch (default: %(default)s)",
    )
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output model directory: new, empty, or an efla run (locked while a run uses it)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (stops if there is none); options left at their "
        "defaults take the values saved in OUT/train_args.json; the schedule and optimizer settings "
        "must stay the same",
    )
    g.add_argument(
        "--resume-or-start", action="store_true", help="like --resume, but start a new run when --out has no checkpoint"
    )
    g.add_argument("--resume-from", default=None, metavar="CKPT_DIR", help="continue from this checkpoint")
    g.add_argument(
        "--extend-at-min-lr",
        action="store_true",
        help="resuming with a larger --max-steps: the saved schedule runs to its planned end, then the "
        "extra steps train at --min-lr",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start again in an --out that has checkpoints, or write into a directory that is not an efla run",
    )
    g.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="default: %(default)s")
    g.add_argument(
        "--time-limit",
        type=float,
        default=d.time_limit,
        metavar="SECONDS",
        help="stop at the first step after SECONDS of this process, with a checkpoint and the model "
        "directory; continue with --resume (default: no limit)",
    )
    g.add_argument("--val-every", type=int, default=d.val_every, help="validation every N steps (0: only at the end)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="log.jsonl entry every N steps")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    g.add_argument(
        "--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    g.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per block) instead of DDP under torchrun")
    g.add_argument(
        "--context-parallel",
        type=int,
        default=d.context_parallel,
        metavar="N",
        help="split each sequence into N contiguous parts over N ranks (under torchrun; N divides the "
        "number of processes, data parallelism runs across the groups; default: %(default)s)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar and no lines for the long phases (tokenizer, tokenizing, checkpoints)",
    )
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from efla.training.trainer import TrainConfig, main_ddp_cleanup, train

    _refuse_ignored_options(args)
    cfg = TrainConfig(**_given_options(args))
    if args.config_file:
        cfg.preset = None
    try:
        res = train(cfg, log=_phase_lines(args.progress))
    except BaseException:
        main_ddp_cleanup()
        raise
    main_ddp_cleanup(finished=True)
    if "final_loss" in res:
        vl = res["val_loss"]
        print(
            f"{res['steps']} steps, {res['tokens']:,} tokens; final loss {res['final_loss']:.4f}"
            + (f", validation loss {vl:.4f}" if vl is not None else "")
            + (f"; {res['tokens_per_s']:,.0f} tokens/s after warm-up" if res["tokens_per_s"] else "; nothing left to train")
            + _peak_memory_text(res.get("peak_memory_gib_per_gpu"))
            + f". Model directory: {res['out']}"
            + _stopped_early_text(res),
            file=sys.stderr,
        )
    return 0


def _stopped_early_text(res: dict) -> str:
    if not res.get("stopped_early"):
        return ""
    return f"; stopped at step {res['steps']} of {res['max_steps']} (--time-limit), continue with --resume"


def _phase_lines(progress: bool):
    """What ``train`` tells of its long phases: one line each on stderr above the progress bar; nothing with
    --no-progress."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return lambda message: tqdm.write(f"efla train: {message}", file=sys.stderr)


def _peak_memory_text(per_gpu: list[float] | None) -> str:
    if not per_gpu:
        return ""
    return "; peak GPU memory " + ", ".join(f"{g:.1f}" for g in per_gpu) + " GiB" + (" per GPU" if len(per_gpu) > 1 else "")


def _refuse_ignored_options(args) -> None:
    """Options given on the command line that this run would not use."""
    from efla import arg_checks as check

    if not (args.resume or args.resume_or_start or args.resume_from):
        check.not_ignored(
            args, {"extend_at_min_lr": "--extend-at-min-lr"}, "on a new run; it extends a run continued with --resume"
        )
    if check.given(args, "max_steps"):
        check.not_ignored(args, {"max_tokens": "--max-tokens"}, "with --max-steps, which sets the length of the run")
    if args.tokenizer not in (None, "", "bpe"):
        check.not_ignored(
            args,
            {"vocab_size": "--vocab-size", "tokenizer_train_chars": "--tokenizer-train-chars"},
            "with --tokenizer NAME: they shape the BPE trained when no --tokenizer is given",
        )


def _given_options(args) -> dict:
    """TrainConfig fields from the command line; when resuming, what it does not give comes from the
    run's saved ``train_args.json``, and a given option that would change the run is refused."""
    import os

    from efla.errors import UsageError
    from efla.training.config import TrainConfig, check_resume_unchanged, stored_train_args

    fields = TrainConfig.__dataclass_fields__
    resuming = args.resume or args.resume_or_start or args.resume_from
    _check_something_to_resume(args)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.resume_from))) if args.resume_from else args.out
    saved = stored_train_args(run_dir) if resuming else None
    if saved is None:
        given = {k: v for k, v in vars(args).items() if k in fields}
    else:
        explicit = {k: getattr(args, k) for k in args.given_options if k in fields}
        check_resume_unchanged(saved, explicit)
        given = {
            **{k: v for k, v in saved.items() if k in fields},
            **_run_length(explicit),
            "out": args.out,
            "resume": args.resume,
            "resume_or_start": args.resume_or_start,
            "resume_from": args.resume_from,
            "overwrite": False,
        }
    if not given.get("data") and resuming:
        raise UsageError(f"{run_dir}: no run that saved its training text to resume; give the text to start one (--out, --data)")
    if not given.get("data"):
        raise UsageError("give the training text (--data)")
    return given


def _check_something_to_resume(args) -> None:
    """``--resume`` with no checkpoint in --out stops before the run's other settings are judged."""
    from efla.errors import UsageError
    from efla.training.checkpoint import list_checkpoints

    if args.resume and not args.resume_or_start and not args.resume_from and not list_checkpoints(args.out):
        raise UsageError(
            f"{args.out} has no checkpoint to resume from; pass --resume-or-start to start a new run "
            "when there is none (--resume)"
        )


def _run_length(explicit: dict) -> dict:
    """A resume given ``--max-tokens`` alone is measured by it, not by the saved ``--max-steps``."""
    if "max_tokens" in explicit and "max_steps" not in explicit:
        return dict(explicit, max_steps=None)
    return explicit
