"""CPU speed of the short convolution at inference (no autograd): ``ShortConvolution``'s sum of
shifted inputs against ``F.conv1d`` (oneDNN's depthwise convolution, the path it took before).

oneDNN compiles a kernel the first time it meets an input shape and keeps it in a cache of up to
1,024 shapes; a server or ``generate`` meets a new shape with nearly every prompt length. So each
case is timed twice: the same shape call after call (the kernel compiled), and a shape never run
before at every call (each call takes the next length of one counter, so neither side has seen
it). The model cases are a no-grad prefill of a tiny preset (``use_cache=True``, one prompt of a new
length per call), the baseline the same model with its convolutions through ``F.conv1d``.
Every side warms up once, then ``--rounds`` rounds alternate ours and the baseline in one process.

Usage: python benchmarks/cpu_short_conv.py [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import time

import evidence
import torch
import torch.nn.functional as F
from alternate import alternate, default_out, load_average, spread

from efla.layers.modules import ShortConvolution

WIDTH = 4
SAME_SHAPES = [(1, 37), (4, 100), (16, 31), (8, 64), (16, 200), (64, 256)]  # (rows, length)
CHANNELS = (64, 1024)  # tiny presets' q/k/v width; 340m's
OURS, BASELINE = "sum of shifted inputs", "F.conv1d (oneDNN)"


def conv1d_forward(conv: ShortConvolution, x: torch.Tensor, cache: torch.Tensor | None, output_final_state: bool):
    """``ShortConvolution``'s output and state through ``F.conv1d``: the baseline."""
    B, T, D = x.shape
    history = cache.to(x.dtype) if cache is not None else x.new_zeros(B, D, WIDTH)
    full = torch.cat([history, x.transpose(1, 2)], dim=-1)
    y = F.conv1d(full[..., 1:], conv.weight, conv.bias, groups=D)
    state = full[..., -WIDTH:].contiguous() if output_final_state else None
    return conv._act(y.transpose(1, 2)), state


@contextlib.contextmanager
def through_conv1d():
    """Every ``ShortConvolution`` at inference takes ``F.conv1d`` meanwhile."""
    shifted = ShortConvolution._forward_shifted
    ShortConvolution._forward_shifted = conv1d_forward
    try:
        yield
    finally:
        ShortConvolution._forward_shifted = shifted


def per_call(fn, calls: int) -> float:
    """Mean seconds of ``calls`` calls of ``fn()``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def same_shape_case(conv, rows: int, length: int, rounds: int) -> dict:
    x, cache = torch.randn(rows, length, conv.hidden_size), torch.randn(rows, conv.hidden_size, WIDTH)
    calls = max(3, int(2e6 // x.numel()))
    methods = {
        OURS: lambda: per_call(lambda: conv(x, cache=cache, output_final_state=True), calls),
        BASELINE: lambda: per_call(lambda: conv1d_forward(conv, x, cache, True), calls),
    }
    return timed(f"D {conv.hidden_size}, [{rows}, {length}], the same shape each call", methods, rounds)


def new_shape_case(conv, rows: int, lengths, rounds: int, calls: int = 8) -> dict:
    def fresh(fn):
        def call():
            x = torch.randn(rows, next(lengths), conv.hidden_size)
            return fn(x, torch.randn(rows, conv.hidden_size, WIDTH))

        return lambda: per_call(call, calls)

    methods = {
        OURS: fresh(lambda x, cache: conv(x, cache=cache, output_final_state=True)),
        BASELINE: fresh(lambda x, cache: conv1d_forward(conv, x, cache, True)),
    }
    return timed(f"D {conv.hidden_size}, {rows} rows, a new length each call", methods, rounds)


def model_case(preset: str, lengths, rounds: int, calls: int = 4) -> dict:
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(preset)).eval()

    def prefill():
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, next(lengths))), use_cache=True)

    def baseline():
        with through_conv1d():
            prefill()

    methods = {OURS: lambda: per_call(prefill, calls), BASELINE: lambda: per_call(baseline, calls)}
    return timed(f"{preset} prefill of one prompt, a new length each call", methods, rounds)


def timed(case: str, methods: dict, rounds: int) -> dict:
    per_round, _ = alternate(methods, rounds)
    in_ms = {name: [t * 1e3 for t in values] for name, values in per_round.items()}
    m = evidence.measurement(case, "time per call", "ms", "lower", (OURS, in_ms[OURS]), (BASELINE, in_ms[BASELINE]))
    ours, theirs = (statistics.median(in_ms[name]) for name in (OURS, BASELINE))
    print(f"{case}: ours {ours:.3f} ms, conv1d {theirs:.3f} ms, speed-up {spread(m)}", flush=True)
    return m


def largest_difference(conv) -> float:
    """Largest absolute difference of the two paths' outputs over a few shapes (inputs ~ N(0, 1))."""
    worst = 0.0
    for rows, length in SAME_SHAPES[:3]:
        x, cache = torch.randn(rows, length, conv.hidden_size), torch.randn(rows, conv.hidden_size, WIDTH)
        ours, theirs = conv(x, cache=cache)[0], conv1d_forward(conv, x, cache, False)[0]
        worst = max(worst, (ours - theirs).abs().max().item())
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per case (every one is recorded)")
    ap.add_argument("--out", default=default_out("cpu_short_conv"), help="the JSON record (benchmarks/evidence.py's shape)")
    args = ap.parse_args(argv)
    load_before = load_average()
    lengths = itertools.count(300)  # one counter: every call of either side meets a length not run before
    measurements, differences = [], []
    with torch.no_grad():
        for channels in CHANNELS:
            torch.manual_seed(0)
            conv = ShortConvolution(channels, WIDTH, bias=False, activation="silu")
            differences.append(f"D {channels}: {largest_difference(conv):.1e}")
            measurements += [same_shape_case(conv, rows, length, args.rounds) for rows, length in SAME_SHAPES]
            measurements += [new_shape_case(conv, rows, lengths, args.rounds) for rows in (1, 8)]
        measurements.append(model_case("tiny-efla", lengths, args.rounds))
    notes = [
        f"float32, no autograd, {torch.get_num_threads()} torch threads; width {WIDTH}, SiLU, the state returned; per "
        f"case one warm-up call of each side, then {args.rounds} rounds alternating ours then conv1d in one process",
        "largest output difference of the two paths: " + "; ".join(differences),
        f"load average before: {load_before}",
    ]
    title = "CPU short convolution at inference: sum of shifted inputs vs F.conv1d (oneDNN)"
    evidence.write_run(args.out, "cpu_short_conv", title, args.rounds, measurements, notes)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
