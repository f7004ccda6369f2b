"""CPU throughput of the tiny preset models: training (fwd+bwd) and inference tokens/s.

For each variant (EFLA, Gated EFLA, DeltaNet, Gated DeltaNet) of a preset size (default
``tiny``), times in float32: a training step's forward + backward (``loss.backward()``, no
optimizer step), a no-grad forward, and greedy decoding with the cache. Variants are run in
rotation (one warm-up step each first), every round kept, so a busy machine slows all of them
alike; EFLA is compared with DeltaNet and Gated EFLA with Gated DeltaNet, the same models with the
Euler step.

Usage: python benchmarks/cpu_model.py [--size tiny] [--batch 8] [--seq-len 256] [--rounds 5]
                                      [--threads 1,2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import evidence
import torch
import transformers
from alternate import alternate, default_out, load_average, spread

from efla.models import EFLAForCausalLM, get_preset_config

VARIANTS = ("efla", "deltanet", "gated-efla", "gated-deltanet")
PAIRS = (("efla", "deltanet"), ("gated-efla", "gated-deltanet"))  # (exact step, its Euler baseline)
METRICS = ("train step fwd+bwd", "forward", "decode")


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
    ap.add_argument("--rounds", type=int, default=5, help="rotated rounds (every one is recorded)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--threads", default=None, help="comma-separated torch.set_num_threads values, one table each (default: torch's choice)"
    )
    ap.add_argument("--out", default=default_out("cpu_model"), help="the JSON record (benchmarks/evidence.py's shape)")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()
    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    load_before = load_average()
    measurements = []
    for n in thread_counts:
        torch.set_num_threads(n)
        tokens = (args.batch * args.seq_len, args.batch * args.seq_len, args.batch)
        measurements += records(run(args), tokens, args.size, f"batch {args.batch} x {args.seq_len}, {n} threads")
    for m in measurements:
        print(f"{m['case']}, {m['metric']}: {spread(m)}", flush=True)
    notes = [
        f"float32; torch threads {', '.join(map(str, thread_counts))}; batch {args.batch} x {args.seq_len} random tokens.",
        "train: loss.backward() of model(ids, labels=ids) (fwd+bwd, no optimizer step); forward: no-grad "
        "model(ids, use_cache=False); decode: greedy transformers generate() with our cache from a 32-token prompt, "
        f"per token of t({args.decode_tokens} + 1 new) - t(1 new), prefill excluded.",
        f"One warm-up round (train, forward, decode) per variant, then {args.rounds} rounds rotating the four variants "
        "(efla, deltanet, gated-efla, gated-deltanet) in one process; every round kept.",
        "The baseline is our own Euler-step variant of the same size (DeltaNet, Gated DeltaNet) through the same "
        "code: what the exact step costs, not a comparison with another library.",
        f"load average before: {load_before}",
    ]
    title = f"CPU {args.size} models: EFLA / Gated EFLA vs the same-size DeltaNet / Gated DeltaNet (our Euler step), float32"
    evidence.write_run(args.out, "cpu_model", title, args.rounds, measurements, notes)
    print(f"wrote {os.path.relpath(args.out)}")


def records(seconds: dict, tokens: tuple, size: str, shape: str) -> list[dict]:
    """One measurement per metric and (exact, Euler) pair, tokens/s round by round, from
    ``seconds[variant] = [(train s, forward s, decode s per token) of each round]`` and the tokens
    each of those three covers."""

    def rate(variant, i):
        return f"{size}-{variant}", [tokens[i] / r[i] for r in seconds[variant]]

    return [
        evidence.measurement(
            f"{size}-{ours} vs {size}-{theirs}, {shape}", metric, "tokens/s", "higher", rate(ours, i), rate(theirs, i)
        )
        for ours, theirs in PAIRS
        for i, metric in enumerate(METRICS)
    ]


def run(args) -> dict:
    """Every variant's ``(train s, forward s, decode s per token)`` of each rotated round."""
    B, T = args.batch, args.seq_len
    models = {}
    for v in VARIANTS:
        torch.manual_seed(0)
        models[v] = EFLAForCausalLM(get_preset_config(f"{args.size}-{v}"))
    ids = torch.randint(0, models["efla"].config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :32]

    def step(v):
        m = models[v]
        m.train()
        train = fwd_bwd(m, ids)
        m.eval()
        return train, fwd(m, ids), decode(m, prompt, args.decode_tokens)

    seconds, _ = alternate({v: partial(step, v) for v in VARIANTS}, args.rounds)
    for v in VARIANTS:
        tr, fw, de = (statistics.median(r[i] for r in seconds[v]) for i in range(3))
        print(
            f"{args.size}-{v} ({torch.get_num_threads()} threads, {models[v].num_parameters():,} parameters): "
            f"fwd+bwd {B * T / tr:,.0f} tok/s ({tr * 1e3:.0f} ms), fwd {B * T / fw:,.0f} tok/s, decode {B / de:,.0f} tok/s",
            flush=True,
        )
    return seconds


if __name__ == "__main__":
    main()
