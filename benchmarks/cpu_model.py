"""CPU throughput of the tiny preset models: training (fwd+bwd) and inference tokens/s.

For each variant (EFLA, Gated EFLA, DeltaNet, Gated DeltaNet) of a preset size (default
``tiny``), times in float32: a training step's forward + backward (``loss.backward()``, no
optimizer step), a no-grad forward, and greedy decoding with the cache. Variants are run in
rotation and medians are reported, so a busy machine slows all of them alike.

Usage: python benchmarks/cpu_model.py [--size tiny] [--batch 8] [--seq-len 256] [--reps 5]
                                      [--threads 1,2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import transformers

from efla.models import EFLAForCausalLM, get_preset_config

VARIANTS = ("efla", "deltanet", "gated-efla", "gated-deltanet")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fwd_bwd(model, ids) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


@torch.no_grad()
def fwd(model, ids) -> float:
    t0 = time.perf_counter()
    model(ids, use_cache=False)
    return time.perf_counter() - t0


@torch.no_grad()
def decode(model, ids, new_tokens) -> float:
    """Seconds per generated token (prefill excluded: the prefill alone is timed and subtracted)."""
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens + 1, **kw)
    t2 = time.perf_counter()
    return max((t2 - t1) - (t1 - t0), 1e-9) / new_tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="preset size: tiny | 340m | 1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--threads", default=None, help="comma-separated torch.set_num_threads values, one table each (default: torch's choice)"
    )
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()
    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    text = "\n".join(run(args, n) for n in thread_counts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def run(args, threads: int) -> str:
    torch.set_num_threads(threads)

    B, T = args.batch, args.seq_len
    models, params = {}, {}
    for v in VARIANTS:
        torch.manual_seed(0)
        cfg = get_preset_config(f"{args.size}-{v}")
        models[v] = EFLAForCausalLM(cfg)
        params[v] = models[v].num_parameters()
    ids = torch.randint(0, models["efla"].config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :32]

    times = {v: {"train": [], "fwd": [], "decode": []} for v in VARIANTS}
    for v in VARIANTS:  # warm-up
        models[v].train()
        fwd_bwd(models[v], ids)
        models[v].eval()
        fwd(models[v], ids)
    for _ in range(args.reps):
        for v in VARIANTS:  # rotate so load changes hit every variant
            m = models[v]
            m.train()
            times[v]["train"].append(fwd_bwd(m, ids))
            m.eval()
            times[v]["fwd"].append(fwd(m, ids))
            times[v]["decode"].append(decode(m, prompt, args.decode_tokens))

    rows = []
    for v in VARIANTS:
        tr, fw, de = (statistics.median(times[v][k]) for k in ("train", "fwd", "decode"))
        rows.append((v, params[v], B * T / tr, B * T / fw, prompt.shape[0] / de, tr))
        print(
            f"{args.size}-{v}: fwd+bwd {B * T / tr:,.0f} tok/s, fwd {B * T / fw:,.0f} tok/s, "
            f"decode {prompt.shape[0] / de:,.0f} tok/s",
            flush=True,
        )

    lines = [
        f"### CPU model throughput, `{args.size}` presets, float32 (`benchmarks/cpu_model.py`, {datetime.date.today()})",
        "",
        f"CPU: {cpu_name()} ({threads} thread{'s' if threads != 1 else ''}); torch {torch.__version__}; "
        f"transformers {transformers.__version__}; batch {B} x {T} tokens; medians of {args.reps} rotated runs.",
        f"Decoding: greedy `generate()` with the cache from a {prompt.shape[1]}-token prompt, batch {prompt.shape[0]}, "
        f"{args.decode_tokens} new tokens (prefill subtracted).",
        "",
        "| preset | parameters | train fwd+bwd (tokens/s) | step time | forward only (tokens/s) | decoding (tokens/s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v, n, tr, fw, de, st in rows:
        lines.append(f"| `{args.size}-{v}` | {n:,} | {tr:,.0f} | {st * 1e3:.0f} ms | {fw:,.0f} | {de:,.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
