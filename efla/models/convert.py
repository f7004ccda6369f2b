"""Turn a flash-linear-attention DeltaNet / Gated DeltaNet checkpoint into an ``efla`` model.

Our models use fla's module and parameter names, so the conversion maps every tensor by name
(one-to-one) and every architecture field of the config by name. ``update_rule="euler"``
reproduces the original model; ``update_rule="exact"`` gives EFLA with the same weights (raw
keys instead of L2-normalised ones), e.g. to fine-tune. Hybrid checkpoints (config ``attn``: some
blocks are softmax attention) convert the same way: those blocks become :class:`efla.layers.Attention`
with fla's parameter names and rotary convention, and only the linear blocks change with ``update_rule``.
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import shutil

import torch
from safetensors.torch import load_file

from efla.models import EFLAConfig, EFLAForCausalLM

FLA_MODEL_TYPES = {"delta_net": False, "gated_deltanet": True}  # model_type -> gated

# fla config fields that exist only for fla's fused kernels / losses and do not change the weights
# or the function the model computes.
_IGNORED = {
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
    "use_l2warp",
    "use_output_norm",
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "auto_map",
    "attnres_block_size",
    "_name_or_path",
}
_ARCH_FIELDS = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_heads",
    "expand_k",
    "expand_v",
    "head_dim",
    "num_v_heads",
    "use_gate",
    "output_gate_activation",
    "use_short_conv",
    "conv_size",
    "conv_bias",
    "use_beta",
    "qk_activation",
    "qk_norm",
    "allow_neg_eigval",
    "hidden_ratio",
    "intermediate_size",
    "hidden_act",
    "norm_eps",
    "initializer_range",
    "max_position_embeddings",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attn_mode",
    "attn",
]
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "added_tokens.json",
)


def fla_config_to_efla(fla_cfg: dict, update_rule: str) -> EFLAConfig:
    """Map an fla ``config.json`` dict to an :class:`EFLAConfig` with ``update_rule``."""
    mt = fla_cfg.get("model_type")
    if mt not in FLA_MODEL_TYPES:
        raise ValueError(f"src: expected an fla config with model_type 'delta_net' or 'gated_deltanet', got {mt!r}")
    if fla_cfg.get("attnres_block_size"):
        raise ValueError("src: checkpoints with 'attnres_block_size' are not supported")
    if update_rule not in ("exact", "euler"):
        raise ValueError(f"update_rule: expected 'exact' or 'euler', got {update_rule!r}")
    kwargs = {f: fla_cfg[f] for f in _ARCH_FIELDS if f in fla_cfg}
    kwargs["attn"] = _single_attn_spec(fla_cfg.get("attn"))
    unknown = sorted(set(fla_cfg) - set(_ARCH_FIELDS) - _IGNORED)
    if kwargs.get("attn_mode") not in (None, "chunk", "recurrent", "fused_recurrent"):
        kwargs.pop("attn_mode")
    cfg = EFLAConfig(update_rule=update_rule, gated=FLA_MODEL_TYPES[mt], **kwargs)
    cfg.converted_from = {"model_type": mt, "ignored_fields": unknown}
    return cfg


def _refuse_misspelt_fields(fla_cfg: dict, path: pathlib.Path) -> None:
    """The config is fla's, whose newer versions add fields we report as ignored; but a key within a
    letter or two of an architecture field is that field misspelt, and converting would drop its value."""
    from efla.arg_checks import place_of_key  # noqa: PLC0415

    for key in sorted(set(fla_cfg) - set(_ARCH_FIELDS) - _IGNORED):
        nearest = difflib.get_close_matches(key, _ARCH_FIELDS, n=1, cutoff=0.85)
        if nearest:
            raise ValueError(f"src: {place_of_key(str(path), key)}: unknown key {key!r}; did you mean {nearest[0]!r}?")


def _single_attn_spec(attn):
    # fla also accepts a list of specifications (different attention settings per layer); one of
    # them is the same as the dict form
    if isinstance(attn, list) and len(attn) == 1:
        return attn[0]
    if isinstance(attn, list) and len(attn) > 1:
        raise ValueError(
            f"src: config 'attn' lists {len(attn)} attention specifications (different settings per "
            "layer); only one (a dict) is supported"
        )
    return attn or None


def _load_tensors(src: pathlib.Path) -> dict[str, torch.Tensor]:
    single = src / "model.safetensors"
    index = src / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for s in shards:
            out.update(load_file(str(src / s)))
        return out
    if any(src.glob("*.bin")) or any(src.glob("*.pt")):
        raise ValueError(
            f"src: {src} holds only pickle weights (.bin/.pt); convert them to safetensors first (efla never unpickles weights)"
        )
    raise ValueError(f"src: no model.safetensors or model.safetensors.index.json in {src}")


def convert_fla_checkpoint(src, dst, update_rule: str = "exact", dtype: torch.dtype | None = None) -> dict:
    """Convert the fla model directory ``src`` into an efla model directory ``dst``.

    Every tensor is mapped by name; a missing, unexpected or wrongly shaped tensor raises
    ``ValueError`` listing them. Tokenizer files are copied. Returns a small report dict.

    Examples:
        >>> # convert_fla_checkpoint("fla-deltanet-340m", "efla-340m", update_rule="exact")  # doctest: +SKIP
    """
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"src: no config.json in {src}")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"dst: {dst} exists and is not empty")
    fla_cfg = json.loads(cfg_path.read_text())
    _refuse_misspelt_fields(fla_cfg, cfg_path)
    cfg = fla_config_to_efla(fla_cfg, update_rule)
    tensors = _load_tensors(src)
    with torch.device("meta"):
        model = EFLAForCausalLM(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    wrong = sorted(
        f"{k}: checkpoint {tuple(tensors[k].shape)}, model {want[k]}"
        for k in set(want) & set(tensors)
        if tuple(tensors[k].shape) != want[k]
    )
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}")
        if wrong:
            parts.append(f"wrong shape {len(wrong)}: {'; '.join(wrong[:10])}")
        raise ValueError(f"src: checkpoint does not match the {cfg.variant} architecture from its config: " + " | ".join(parts))
    model = EFLAForCausalLM(cfg)
    model.load_state_dict(tensors, strict=not cfg.tie_word_embeddings)
    if dtype is not None:
        model = model.to(dtype)
    tmp = dst.with_name(dst.name + ".tmp-convert")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    copied = []
    for name in _TOKENIZER_FILES:
        if (src / name).is_file() and not (tmp / name).exists():
            shutil.copy2(src / name, tmp / name)
            copied.append(name)
    if dst.exists():
        dst.rmdir()
    os.replace(tmp, dst)
    return dict(
        src=str(src),
        dst=str(dst),
        model_type=fla_cfg["model_type"],
        variant=cfg.variant,
        tensors=len(tensors),
        parameters=sum(p.numel() for p in model.parameters()),
        attention_layers=list(cfg.attn["layers"]) if cfg.attn else [],
        ignored_config_fields=cfg.converted_from["ignored_fields"],
        copied_files=copied,
    )
