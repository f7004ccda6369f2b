"""What ``efla generate`` and ``efla serve`` share: the saved model's options (MODEL_DIR, --device,
--dtype), their checks before anything loads, and the loading itself."""

from __future__ import annotations

import json
import os

from efla.errors import UsageError


def add_model_options(parser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--device", default="auto", metavar="D", help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on the CPU (float16 needs CUDA)",
    )


def checked_device_and_dtype(args):
    """``(device, torch dtype)`` from ``--device`` and ``--dtype``, or a one-line mistake."""
    device = check_device(args.device)
    return device, check_dtype(args.dtype, device)


def check_model_dir(path: str, option: str = "MODEL_DIR") -> None:
    """A saved efla model: config.json with model_type 'efla', safetensors weights, tokenizer files
    (``option``: the argument named in a mistake's message)."""
    from efla import arg_checks as check

    check.existing_dir(path, option)
    names = set(os.listdir(path))
    config = os.path.join(path, "config.json")
    if "config.json" not in names:
        raise UsageError(f"{path} is not a model directory: no config.json ({option})")
    try:
        with open(config, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{config}: not a readable JSON config ({' '.join(str(error).split())}) ({option})") from None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type != "efla":
        raise UsageError(
            f"{config}: model_type {model_type!r} is not an efla model (expected 'efla'; "
            f"`efla convert` turns fla DeltaNet checkpoints into one) ({option})"
        )
    from efla.models.configuration_efla import config_file_keys

    check.known_keys(cfg, config_file_keys(), config, "MODEL_DIR")  # ours to refuse: the 'efla' model type
    if not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        raise UsageError(f"{path} has a config.json but no safetensors weights (*.safetensors) ({option})")
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise UsageError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json) ({option})")


def check_device(name: str) -> str:
    """The device to run on (``auto``: cuda if available, else cpu)."""
    import torch

    from efla import arg_checks as check

    check.device(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if index and (kind != "cuda" or not index.isdigit()):
        raise UsageError(f"unknown device {name!r}; expected auto, cpu, cuda or cuda:N (--device)")
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(f"{name} requested but there are {torch.cuda.device_count()} CUDA devices (--device)")
    return name


def check_dtype(name: str, device: str):
    import torch

    if name == "auto":
        name = "bfloat16" if device.startswith("cuda") else "float32"
    if name == "float16" and not device.startswith("cuda"):
        raise UsageError("float16 needs a CUDA device; on the CPU use float32 or bfloat16 (--dtype)")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(path: str, device: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import efla  # noqa: F401  (registers the efla model type with transformers)

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar on stderr: the output is the text
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), tokenizer


def stop_tokens_of(model, tokenizer) -> list[int]:
    """The tokenizer's eos, else the model's generation_config eos (none: generate to the length)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
