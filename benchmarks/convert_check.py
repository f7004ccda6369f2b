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
    args = ap.parse_args(argv)
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM, GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from transformers import AutoModelForCausalLM

    import efla  # noqa: F401
    from efla.convert import convert_fla_checkpoint

    rows = []
    cases = [
        ("delta_net", DeltaNetForCausalLM, DeltaNetConfig(hidden_size=512, num_hidden_layers=4, num_heads=4,
                                                          vocab_size=1000, use_gate=True)),
        ("gated_deltanet", GatedDeltaNetForCausalLM, GatedDeltaNetConfig(hidden_size=512, num_hidden_layers=4,
                                                                         num_heads=4, head_dim=128, vocab_size=1000)),
    ]
    for name, cls, cfg in cases:
        torch.manual_seed(0)
        fla_model = cls(cfg)
        with tempfile.TemporaryDirectory() as d:
            fla_model.save_pretrained(f"{d}/fla")
            convert_fla_checkpoint(f"{d}/fla", f"{d}/efla", update_rule="euler")
            ours = AutoModelForCausalLM.from_pretrained(f"{d}/efla")
        ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
        fla_model = fla_model.cuda().to(torch.bfloat16).eval()
        ours = ours.cuda().to(torch.bfloat16).eval()
        with torch.no_grad():
            a = fla_model(ids).logits.float()
            b = ours(ids).logits.float()
        rel = ((a - b).norm() / a.norm()).item()
        maxrel = ((a - b).abs().max() / a.abs().max()).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        rows.append(dict(model_type=name, shape=list(ids.shape), rel_err_fro=rel, rel_err_max=maxrel,
                         argmax_agreement=agree, passed=rel < 2e-2))
        print(f"{name}: fla vs converted efla (euler), bf16 logits: rel err {rel:.2e} (max-abs rel {maxrel:.2e}), "
              f"argmax agreement {agree:.4f} -> {'PASS' if rel < 2e-2 else 'FAIL'}", flush=True)
    with open(os.path.join(args.out, "convert_check.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
