"""CPU generation speed: ``efla.generation.generate`` against transformers' ``generate`` (with its
cache) on the same tiny model, float32, greedy, no early stop.

For each preset and batch, both methods make a warm-up call, then take turns (ours, transformers,
ours, ...) for ``--reps`` rounds; a round times a call making ``--new-tokens`` tokens and a call
making one (the prefill). From the medians: decode tokens/s ``B (n - 1) / (t_all - t_pre)`` and
end-to-end new tokens/s ``B n / t_all``. Alternating means a busy machine slows both alike.

Usage: python benchmarks/cpu_generate.py [--presets tiny-efla,tiny-gated-efla,tiny-hybrid-efla]
           [--batches 1,8] [--prompt 64] [--new-tokens 64] [--reps 5] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import transformers

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config


def ours(model, ids, n):
    return generate(model, ids, max_new_tokens=n, eos_token_id=[])


def theirs(model, ids, n):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
    )


def seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(model, ids, n, reps) -> dict:
    methods = {"efla.generation": ours, "transformers": theirs}
    samples = {name: ([], []) for name in methods}
    for fn in methods.values():
        fn(model, ids, n)
    for _ in range(reps):
        for name, fn in methods.items():
            samples[name][0].append(seconds(fn, model, ids, n))
            samples[name][1].append(seconds(fn, model, ids, 1))
    B = ids.shape[0]
    rows = {}
    for name, (alls, pres) in samples.items():
        t_all, t_pre = statistics.median(alls), statistics.median(pres)
        rows[name] = dict(decode=B * (n - 1) / (t_all - t_pre), e2e=B * n / t_all, ms=1e3 * (t_all - t_pre) / (n - 1))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny-efla,tiny-gated-efla,tiny-hybrid-efla")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    lines = [
        f"`python benchmarks/cpu_generate.py --threads {args.threads}` ({datetime.date.today()}): torch "
        f"{torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, float32, "
        f"greedy, prompt {args.prompt}, {args.new_tokens} new tokens, medians of {args.reps} alternated rounds.",
        "",
        "| preset | batch | ours decode tokens/s | transformers decode tokens/s | ours ms/step | "
        "transformers ms/step | decode speed-up | end-to-end speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        model = EFLAForCausalLM(get_preset_config(preset)).eval()
        for B in map(int, args.batches.split(",")):
            ids = torch.randint(3, model.config.vocab_size, (B, args.prompt))
            r = measure(model, ids, args.new_tokens, args.reps)
            a, b = r["efla.generation"], r["transformers"]
            line = (
                f"| `{preset}` | {B} | {a['decode']:,.0f} | {b['decode']:,.0f} | {a['ms']:.2f} | {b['ms']:.2f} "
                f"| {a['decode'] / b['decode']:.2f}x | {a['e2e'] / b['e2e']:.2f}x |"
            )
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
