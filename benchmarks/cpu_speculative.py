"""CPU speculative decoding: ``generate(..., speculate={"method": "ngram"})`` (prompt lookup) against
plain ``generate`` on the same model, float32, batch 1 and 8, alternated rounds.

Two cases:

- ``repeating``: greedy decoding of a random-weight model at its default initialisation. Such a
  model's greedy text falls into loops within a few dozen tokens (the tests rely on it too), and
  prompt lookup then drafts the loop's next tokens from the text so far: the honest stand-in for
  copying text out of the prompt (code editing, quoting), since a random model copies nothing it
  was not looping on anyway. The prompt holds a first run of that greedy text, so the loop is
  there from the start as when a prompt contains the text to reproduce.
- ``free``: sampling at temperature 1 from a random prompt: tokens nearly uniform over the
  vocabulary, so lookup finds few drafts and nearly all are rejected; speculation has to turn
  itself down (the adaptive draft length and pauses) to stay near the plain speed.

Per case and batch: new tokens/s of both (each round times one call of each, ours first, then the
baseline, for ``--rounds`` rounds), the acceptance rate (kept / drafted tokens) and the new tokens
per target pass. Then the batch-1 plain decoding step against a floor: the bytes a step must read
(all weights, the recurrent and convolution state read and written) over ``--bandwidth-gbs``
(default: this machine's copy bandwidth, measured; 4800 for an H200). On the CPU the tiny model's
step is launch- and Python-bound, thousands of times its floor: speculation wins here by doing
several tokens' work per pass of that overhead, as a large model on a GPU does per pass of its
weights.

Usage: python benchmarks/cpu_speculative.py [--preset tiny-efla] [--batches 1,8] [--new-tokens 96]
           [--rounds 5] [--threads 2] [--bandwidth-gbs G] [--out benchmarks/results/cpu/speculative.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from evidence import measurement, write_run

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config

SPECULATE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def prompts(model, case: str, batch: int, length: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g)
    if case == "free":
        return ids
    return generate(model, ids, max_new_tokens=length, eos_token_id=[])  # a first run of the greedy text


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def call(model, ids, new_tokens, case, speculate, stats=None):
    sampling = dict(temperature=1.0, seed=list(range(len(ids)))) if case == "free" else {}
    t0 = clock()
    out = generate(
        model, ids, max_new_tokens=new_tokens, eos_token_id=[], speculate=speculate, speculation_stats=stats, **sampling
    )
    return clock() - t0, out


def copy_bandwidth_gbs(megabytes: int = 256, reps: int = 5) -> float:
    """This machine's memory bandwidth as a large copy sees it (bytes read plus written per second)."""
    src = torch.empty(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_bytes(model) -> int:
    """Bytes one batch-1 decoding step must move: every weight read once, the state read and written."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 0
    for block in model.get_decoder().layers:
        attn = block.attn
        state += attn.num_v_heads * attn.head_k_dim * attn.head_v_dim * 4  # float32 matrix state
        if attn.use_short_conv:
            state += (2 * attn.key_dim + attn.value_dim) * attn.conv_size * next(model.parameters()).element_size()
    return weights + 2 * state


def run_case(model, case, batch, args) -> tuple[list[dict], dict]:
    ids = prompts(model, case, batch)
    plain_out = call(model, ids, args.new_tokens, case, None)[1]
    stats = {}
    fast_out = call(model, ids, args.new_tokens, case, SPECULATE, stats)[1]
    if case != "free" and not torch.equal(plain_out, fast_out):
        raise SystemExit(f"{case}, batch {batch}: speculative greedy output differs from plain greedy")
    ours, baseline, acceptance, per_pass, drafted = [], [], [], [], []
    for _ in range(args.rounds):
        stats = {}
        ours.append(batch * args.new_tokens / call(model, ids, args.new_tokens, case, SPECULATE, stats)[0])
        baseline.append(batch * args.new_tokens / call(model, ids, args.new_tokens, case, None)[0])
        acceptance.append(stats["accepted"] / max(1, stats["drafted"]))
        per_pass.append(stats["tokens"] / batch / stats["rounds"])
        drafted.append(stats["drafted"] / stats["tokens"])
    name = f"{args.preset} {case} batch {batch}"
    rows = [
        measurement(name, "drafted tokens per new token", "fraction", "lower", ("speculative (ngram)", drafted), None),
        measurement(name, "new tokens/s", "tokens/s", "higher", ("speculative (ngram)", ours), ("plain generate", baseline)),
        measurement(
            name,
            "acceptance rate",
            "fraction",
            "higher",
            ("speculative (ngram)", acceptance),
            None,
        ),
        measurement(
            name,
            "new tokens per target pass",
            "tokens",
            "higher",
            ("speculative (ngram)", per_pass),
            None,
        ),
    ]
    ratio = [a / b for a, b in zip(ours, baseline)]
    print(
        f"{name}: {statistics.median(ours):,.0f} vs {statistics.median(baseline):,.0f} tokens/s, "
        f"ratio {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f}), "
        f"acceptance {stats['accepted']}/{stats['drafted']}, tokens per pass {per_pass[-1]:.2f}",
        flush=True,
    )
    return rows, {"plain_step_s": [batch / b for b in baseline]}  # seconds per token of a row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-efla")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (on a machine other processes load, with --threads 1)",
    )
    p.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the floor (default: measured copy bandwidth)"
    )
    p.add_argument("--out", default="benchmarks/results/cpu/speculative.json")
    args = p.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(args.preset)).eval()
    measurements, step_times = [], []
    for case in ("repeating", "free"):
        for batch in map(int, args.batches.split(",")):
            rows, extra = run_case(model, case, batch, args)
            measurements += rows
            if batch == 1 and case == "repeating":
                step_times = extra["plain_step_s"]
    bandwidth = args.bandwidth_gbs or copy_bandwidth_gbs()
    source = "given (--bandwidth-gbs)" if args.bandwidth_gbs else "measured: a 256 MiB float32 copy, read plus written"
    floor = step_bytes(model) / (bandwidth * 1e9)
    measurements.append(
        measurement(
            f"{args.preset} batch 1", "plain decoding step", "s", "lower", ("plain generate (1 / tokens/s)", step_times), None
        )
    )
    measurements.append(
        measurement(
            f"{args.preset} batch 1", "step floor: bytes moved / bandwidth", "s", "lower", ("floor", [floor] * args.rounds), None
        )
    )
    print(
        f"batch-1 plain step {statistics.median(step_times) * 1e3:.3f} ms vs floor {floor * 1e6:.3f} us "
        f"({step_bytes(model):,} bytes at {bandwidth:.1f} GB/s, {source}): "
        f"{statistics.median(step_times) / floor:,.0f}x the floor",
        flush=True,
    )
    notes = [
        "repeating: greedy text of a random-weight model at its default initialisation, which loops; the prompt holds "
        "a first run of it (32 random tokens plus their 32-token greedy continuation); greedy output checked equal to "
        "plain greedy before timing",
        "free: temperature-1 sampling from 32 random tokens (per-row seeds); speculation's own draws, same distribution",
        f"speculate={SPECULATE}; {args.new_tokens} new tokens per call; float32; {args.threads} threads; "
        f"clock: {args.clock} ({'elapsed time' if args.clock == 'wall' else 'the process CPU time'})",
        f"bandwidth {bandwidth:.1f} GB/s, {source}; step bytes {step_bytes(model)} (weights once, state read and written)",
        "a round times one speculative call, then one plain call",
    ]
    write_run(
        args.out,
        "cpu_speculative",
        "Speculative decoding (prompt lookup) vs plain generate, CPU",
        args.rounds,
        measurements,
        notes,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
