"""GPU check of `efla convert`: fla's own DeltaNet / Gated DeltaNet vs the converted efla model
(update_rule="euler"), same random weights, bf16 logits on CUDA. Needs flash-linear-attention.

Usage: python benchmarks/convert_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--attn-mode", default="chunk", help="fla's attn_mode (fused_recurrent runs float32)")
    ap.add_argument("--only", default=None, help="delta_net or gated_deltanet")
    args = ap.parse_args(argv)
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM, GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from transformers import AutoModelForCausalLM

    import efla  # noqa: F401
    from efla.convert import convert_fla_checkpoint

    rows = []
    cases = [
        ("delta_net", DeltaNetForCausalLM, DeltaNetConfig(hidden_size=512, num_hidden_layers=4, num_heads=4,
                                                          vocab_size=1000, use_gate=True, attn_mode=args.attn_mode)),
        ("gated_deltanet", GatedDeltaNetForCausalLM, GatedDeltaNetConfig(hidden_size=512, num_hidden_layers=4,
                                                                         num_heads=4, head_dim=128, vocab_size=1000,
                                                                         attn_mode=args.attn_mode)),
    ]
    dtype = getattr(torch, args.dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, cls, cfg in cases:
        if args.only and name != args.only:
            continue
        torch.manual_seed(0)
        fla_model = cls(cfg)
        with tempfile.TemporaryDirectory() as d:
            fla_model.save_pretrained(f"{d}/fla")
            convert_fla_checkpoint(f"{d}/fla", f"{d}/efla", update_rule="euler")
            ours = AutoModelForCausalLM.from_pretrained(f"{d}/efla")
        ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
        fla_model = fla_model.cuda().to(dtype).eval()
        ours = ours.cuda().to(dtype).eval()
        with torch.no_grad():
            a = fla_model(ids).logits.float()
            b = ours(ids).logits.float()
        rel = ((a - b).norm() / a.norm()).item()
        maxrel = ((a - b).abs().max() / a.abs().max()).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        rows.append(dict(model_type=name, shape=list(ids.shape), rel_err_fro=rel, rel_err_max=maxrel,
                         argmax_agreement=agree, dtype=args.dtype, attn_mode=args.attn_mode, passed=rel < tol))
        print(f"{name}: fla ({args.attn_mode}) vs converted efla (euler), {args.dtype} logits: rel err {rel:.2e} "
              f"(max-abs rel {maxrel:.2e}), argmax agreement {agree:.4f} -> {'PASS' if rel < tol else 'FAIL'}", flush=True)
    with open(os.path.join(args.out, f"convert_check_{args.dtype}_{args.attn_mode}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
