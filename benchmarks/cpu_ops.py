"""CPU speed of the chunkwise EFLA and Gated EFLA ops against transformers' pure-PyTorch chunked delta rule.

Baseline: ``torch_chunk_gated_delta_rule`` from ``transformers.models.qwen3_next``, with autograd for
its backward. For ``chunk_efla`` it runs with ``g = 0`` and ``beta = alpha`` (the exact-flow
coefficient), i.e. the same recurrence (the table shows the outputs' difference). For
``chunk_gated_efla`` it runs Gated DeltaNet with the same log gate ``g`` and ``beta``, what a user of
a gated model would run instead; the rules differ (EFLA's exact step), so the table checks our
``chunk_gated_delta_rule`` against it on the same inputs instead. Both timed fwd+bwd in float32:
one warm-up call each, then ``--rounds`` rounds alternating ours and theirs, every round kept. Also
times ``chunk_efla`` against our token-by-token ``recurrent_efla`` at [1, 4096, 4, 64].

Usage: python benchmarks/cpu_ops.py [--rounds 7] [--skip-recurrent] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import evidence
import torch
from alternate import alternate, default_out, load_average, seconds, spread

from efla.ops import chunk_efla, chunk_gated_delta_rule, chunk_gated_efla, efla_coefficient, recurrent_efla

SHAPES = [(2, 1024, 4, 64), (1, 4096, 4, 64), (2, 2048, 8, 128)]


def _inputs(B, T, H, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    q = q / q.norm(dim=-1, keepdim=True)
    k = torch.randn(B, T, H, D, generator=gen) * 0.3
    v = torch.randn(B, T, H, D, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, beta)]


def _gated_inputs(B, T, H, D, seed=0):
    q, k, v, beta = (x.detach() for x in _inputs(B, T, H, D, seed))
    g = -torch.rand(B, T, H, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _fwd_bwd_gated(q, k, v, g, beta, fn=chunk_gated_efla):
    o, _ = fn(q, k, v, g, beta)
    o.sum().backward()


def _fwd_bwd_hf_gated(q, k, v, g, beta):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    o, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta)
    o.sum().backward()


def _fwd_bwd_efla(q, k, v, beta, fn=chunk_efla):
    o, _ = fn(q, k, v, beta)
    o.sum().backward()


def _fwd_bwd_hf(q, k, v, beta):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    alpha = efla_coefficient(beta, k)
    g = torch.zeros_like(beta)
    o, _ = torch_chunk_gated_delta_rule(q, k, v, g, alpha)
    o.sum().backward()


def _time(fn, args, clock=time.perf_counter) -> float:
    """Seconds of one fwd+bwd call, gradients cleared first (not timed)."""
    for x in args:
        x.grad = None
    return seconds(fn, *args, clock=clock)


def _same_rule_difference(op: str, inp) -> float:
    """Max relative difference between transformers' outputs and ours for the same recurrence
    (``chunk_efla`` itself; for the gated op, our Gated DeltaNet op on the same inputs)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    with torch.no_grad():
        if op == "chunk_efla":
            q, k, v, beta = inp
            o_ref, _ = torch_chunk_gated_delta_rule(q, k, v, torch.zeros_like(beta), efla_coefficient(beta, k))
            o_ours, _ = chunk_efla(q, k, v, beta)
        else:
            o_ref, _ = torch_chunk_gated_delta_rule(*inp)
            o_ours, _ = chunk_gated_delta_rule(*inp)
    return ((o_ref - o_ours).abs().max() / o_ref.abs().max()).item()


def compare(case: str, ours: tuple[str, Callable[[], float]], theirs: tuple[str, Callable[[], float]], rounds: int) -> dict:
    """``ours`` and ``theirs`` are ``(name, a call returning its seconds)``: one warm-up call each,
    then ``rounds`` rounds of ours then theirs; the measurement keeps every round in ms."""
    per_round, _ = alternate(dict([ours, theirs]), rounds)
    in_ms = lambda name: (name, [t * 1e3 for t in per_round[name]])  # noqa: E731
    return evidence.measurement(case, "fwd+bwd time", "ms", "lower", in_ms(ours[0]), in_ms(theirs[0]))


def _print_row(m: dict) -> None:
    ours, theirs = (statistics.median(m[side]["rounds"]) for side in ("ours", "baseline"))
    print(f"{m['case']}: {m['ours']['name']} {ours:.1f} ms, baseline {theirs:.1f} ms, speed-up {spread(m)}", flush=True)


HF_RULE = "transformers torch_chunk_gated_delta_rule"
OPS = {  # op: (inputs, ours, the baseline, the baseline's name)
    "chunk_efla": (_inputs, _fwd_bwd_efla, _fwd_bwd_hf, f"{HF_RULE} (g = 0, beta = alpha)"),
    "chunk_gated_efla": (_gated_inputs, _fwd_bwd_gated, _fwd_bwd_hf_gated, f"{HF_RULE} (Gated DeltaNet, same g, beta)"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds per case (every one is recorded)")
    ap.add_argument("--out", default=default_out("cpu_ops"), help="the JSON record (benchmarks/evidence.py's shape)")
    ap.add_argument("--skip-recurrent", action="store_true")
    args = ap.parse_args(argv)
    load_before = load_average()

    measurements, differences = [], []
    for op, (make_inputs, ours, theirs, baseline) in OPS.items():
        for shape in SHAPES:
            inp = make_inputs(*shape)
            differences.append(f"{op} {list(shape)}: {_same_rule_difference(op, inp):.1e}")
            m = compare(
                f"{op} {list(shape)}", (op, partial(_time, ours, inp)), (baseline, partial(_time, theirs, inp)), args.rounds
            )
            _print_row(m)
            measurements.append(m)
    if not args.skip_recurrent:
        inp = _inputs(1, 4096, 4, 64)
        recurrent = partial(_time, partial(_fwd_bwd_efla, fn=recurrent_efla), inp)
        m = compare(
            "chunk_efla vs recurrent_efla [1, 4096, 4, 64]",
            ("chunk_efla", partial(_time, _fwd_bwd_efla, inp)),
            ("recurrent_efla (ours, token by token)", recurrent),
            args.rounds,
        )
        _print_row(m)
        measurements.append(m)

    notes = [
        "Each call: the op's forward on [B, T, H, D] float32 inputs, then o.sum().backward() (fwd+bwd); "
        "gradients cleared before each call, untimed.",
        f"{torch.get_num_threads()} torch threads; per case one warm-up call of each side, then {args.rounds} rounds "
        "alternating ours then the baseline in one process; every round kept.",
        "chunk_efla's baseline runs the same recurrence (g = 0, beta = EFLA's alpha). chunk_gated_efla's baseline "
        "is Gated DeltaNet with the same g and beta (a different rule, what a gated-model user would run instead).",
        "Max relative output difference against transformers, same rule (for the gated op: our chunk_gated_delta_rule): "
        + "; ".join(differences),
        f"load average before: {load_before}",
    ]
    title = "CPU ops, fwd+bwd float32: chunk_efla / chunk_gated_efla vs transformers' pure-PyTorch torch_chunk_gated_delta_rule"
    evidence.write_run(args.out, "cpu_ops", title, args.rounds, measurements, notes)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
