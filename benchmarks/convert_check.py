"""GPU check of `efla convert`: fla's own DeltaNet / Gated DeltaNet vs the converted efla
model (update_rule="euler"), same weights, logits on CUDA. Needs flash-linear-attention.

Two kinds of checkpoints:

* ``random``: random-init fla models (hidden 512, 4 layers), saved by fla, converted, 2 x 300
  random tokens;
* ``trained``: our tiny DeltaNet / Gated DeltaNet language models (``runs/lm/*-s0``, trained by
  ``efla train``; copy ``config.json`` and ``model.safetensors`` of each to ``--trained DIR/NAME``),
  loaded into fla's own model classes (same tensor names, strict), saved by fla, converted back,
  and run on real text (``DIR/ids.pt``: token ids [B, T] from WikiText-2 valid).

For each it reports the relative (Frobenius) error of the logits between fla and efla in
``--dtype`` (bf16 by default) and, to show what bf16 itself costs, the error of each of them
against a float32 reference: fla's model in float32 (``fused_recurrent``) with the same
bf16-rounded weights.

Usage: python benchmarks/convert_check.py [--out DIR] [--dtype bfloat16|float32] [--trained DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).item()


def fla_config_from_efla(efla_cfg: dict, cfg_cls, attn_mode: str):
    """The fla config of the same architecture (fields shared by name)."""
    names = set(inspect.signature(cfg_cls.__init__).parameters) - {"self", "kwargs"}
    kw = {k: v for k, v in efla_cfg.items() if k in names}
    kw["attn_mode"] = attn_mode
    return cfg_cls(**kw)


def compare(name, fla_model, ref_cls, ref_cfg, ids, dtype, kind, rows):
    from transformers import AutoModelForCausalLM

    import efla  # noqa: F401
    from efla.models.convert import convert_fla_checkpoint

    with tempfile.TemporaryDirectory() as d:
        fla_model.save_pretrained(f"{d}/fla")
        convert_fla_checkpoint(f"{d}/fla", f"{d}/efla", update_rule="euler")
        ours = AutoModelForCausalLM.from_pretrained(f"{d}/efla")
    fla_model = fla_model.cuda().to(dtype).eval()
    ours = ours.cuda().to(dtype).eval()
    # float32 reference: fla's fused_recurrent path on the same (dtype-rounded) weights
    ref = ref_cls(ref_cfg)
    ref.load_state_dict({k: v.float() for k, v in fla_model.state_dict().items()})
    ref = ref.cuda().float().eval()
    with torch.no_grad():
        a = fla_model(ids).logits.float()
        b = ours(ids).logits.float()
        r = ref(ids).logits.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    row = dict(
        checkpoint=kind,
        model_type=name,
        dtype=str(dtype).replace("torch.", ""),
        shape=list(ids.shape),
        rel_err_fla_vs_efla=_rel(b, a),
        rel_err_max_abs=((a - b).abs().max() / a.abs().max()).item(),
        argmax_agreement=(a.argmax(-1) == b.argmax(-1)).float().mean().item(),
        rel_err_fla_vs_fp32_ref=_rel(a, r),
        rel_err_efla_vs_fp32_ref=_rel(b, r),
        loss_fla=_loss(a, ids),
        loss_efla=_loss(b, ids),
        loss_fp32_ref=_loss(r, ids),
    )
    row["passed"] = row["rel_err_fla_vs_efla"] < tol
    rows.append(row)
    print(
        f"{kind:8s} {name:15s} {row['dtype']}: fla vs efla {row['rel_err_fla_vs_efla']:.2e} "
        f"(argmax agree {row['argmax_agreement']:.4f}) | vs fp32 ref: fla {row['rel_err_fla_vs_fp32_ref']:.2e}, "
        f"efla {row['rel_err_efla_vs_fp32_ref']:.2e} | loss fla {row['loss_fla']:.4f} efla {row['loss_efla']:.4f} "
        f"ref {row['loss_fp32_ref']:.4f} -> {'PASS' if row['passed'] else 'FAIL'}",
        flush=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--trained",
        default=".devdata/convert",
        help="folder with deltanet-s0/, gated-deltanet-s0/ (config.json + model.safetensors) and ids.pt",
    )
    ap.add_argument("--only", default=None, help="delta_net or gated_deltanet")
    args = ap.parse_args(argv)
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM, GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from safetensors.torch import load_file

    dtype = getattr(torch, args.dtype)
    mode = "chunk" if dtype != torch.float32 else "fused_recurrent"
    classes = {
        "delta_net": (DeltaNetConfig, DeltaNetForCausalLM),
        "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
    }
    rows: list[dict] = []
    # 1. random-init fla checkpoints
    random_cfgs = {
        "delta_net": dict(hidden_size=512, num_hidden_layers=4, num_heads=4, vocab_size=1000, use_gate=True),
        "gated_deltanet": dict(hidden_size=512, num_hidden_layers=4, num_heads=4, head_dim=128, vocab_size=1000),
    }
    ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    for name, kw in random_cfgs.items():
        if args.only and name != args.only:
            continue
        cfg_cls, cls = classes[name]
        torch.manual_seed(0)
        try:
            compare(
                name,
                cls(cfg_cls(attn_mode=mode, **kw)),
                cls,
                cfg_cls(attn_mode="fused_recurrent", **kw),
                ids,
                dtype,
                "random",
                rows,
            )
        except Exception as e:
            print(f"random {name}: failed: {type(e).__name__}: {e}", flush=True)
    # 2. trained checkpoints (ours, loaded into fla's classes)
    ids_path = os.path.join(args.trained, "ids.pt")
    if os.path.exists(ids_path):
        tids = torch.load(ids_path).cuda()
        for sub, name in (("deltanet-s0", "delta_net"), ("gated-deltanet-s0", "gated_deltanet")):
            d = os.path.join(args.trained, sub)
            if (args.only and name != args.only) or not os.path.isdir(d):
                continue
            cfg_cls, cls = classes[name]
            with open(os.path.join(d, "config.json")) as f:
                ecfg = json.load(f)
            try:
                fla_model = cls(fla_config_from_efla(ecfg, cfg_cls, mode))
                fla_model.load_state_dict(load_file(os.path.join(d, "model.safetensors")), strict=True)
                compare(
                    name, fla_model, cls, fla_config_from_efla(ecfg, cfg_cls, "fused_recurrent"), tids, dtype, "trained", rows
                )
            except Exception as e:
                print(f"trained {name}: failed: {type(e).__name__}: {e}", flush=True)
    else:
        print(f"no {ids_path}: trained checkpoints skipped")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"convert_check_{args.dtype}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
