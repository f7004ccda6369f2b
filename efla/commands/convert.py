"""``efla convert``: a flash-linear-attention DeltaNet / Gated DeltaNet checkpoint -> efla model dir."""

from __future__ import annotations

import os

from efla.errors import UsageError


def cmd_convert(args) -> int:
    import torch

    from efla import arg_checks as check
    from efla.models.convert import convert_fla_checkpoint

    check.existing_dir(args.src, "SRC")
    check.output_dir(args.dst, "DST")
    dtype = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        rep = convert_fla_checkpoint(args.src, args.dst, update_rule=args.update_rule, dtype=dtype)
    except ValueError as error:
        raise UsageError(_naming_the_argument(str(error), args.src)) from None
    print(
        f"Converted {rep['model_type']} checkpoint {rep['src']} -> {rep['dst']} as {rep['variant']}: "
        f"{rep['tensors']} tensors, {rep['parameters']:,} parameters."
    )
    if rep["attention_layers"]:
        print(f"Softmax-attention layers (unchanged by --update-rule): {rep['attention_layers']}")
    if rep["ignored_config_fields"]:
        print("Config fields without effect on the weights (ignored): " + ", ".join(rep["ignored_config_fields"]))
    if rep["copied_files"]:
        print("Copied: " + ", ".join(rep["copied_files"]))
    print(
        "Load it with: import efla; from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained({rep['dst']!r})"
    )
    return 0


def _naming_the_argument(message: str, src: str) -> str:
    """``convert_fla_checkpoint``'s ``"src: <what>"`` as ``"<what> (SRC)"``; a message naming no argument
    is about SRC's config (a value EFLAConfig refuses)."""
    argument, _, what = message.partition(": ")
    named = {"src": "SRC", "dst": "DST", "update_rule": "--update-rule"}
    if argument in named:
        return f"{what} ({named[argument]})"
    return f"{os.path.join(src, 'config.json')}: {message} (SRC)"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a flash-linear-attention DeltaNet/Gated DeltaNet checkpoint (hybrids with softmax-attention layers too)",
        description="Convert a flash-linear-attention DeltaNet or Gated DeltaNet model directory "
        "(hybrids with softmax-attention layers too) into an efla model directory that "
        "AutoModelForCausalLM loads after `import efla`; tokenizer files are copied.",
    )
    p.add_argument("src", help="fla model directory (config.json with model_type delta_net or gated_deltanet, safetensors)")
    p.add_argument("dst", help="new efla model directory (must not exist or be empty)")
    p.add_argument(
        "--update-rule",
        choices=["exact", "euler"],
        default="exact",
        help="exact: EFLA with the same weights (default); euler: reproduces the original model",
    )
    p.add_argument(
        "--dtype",
        choices=["keep", "float32", "bfloat16"],
        default="keep",
        help="dtype of the saved weights (keep: as in SRC; default)",
    )
    p.set_defaults(func=cmd_convert)
