"""CPU speed of the chunkwise EFLA and Gated EFLA ops against transformers' pure-PyTorch chunked delta rule.

Baseline: ``torch_chunk_gated_delta_rule`` from ``transformers.models.qwen3_next``, with autograd for
its backward. For ``chunk_efla`` it runs with ``g = 0`` and ``beta = alpha`` (the exact-flow
coefficient), i.e. the same recurrence (the table shows the outputs' difference). For
``chunk_gated_efla`` it runs Gated DeltaNet with the same log gate ``g`` and ``beta``, what a user of
a gated model would run instead; the rules differ (EFLA's exact step), so the table checks our
``chunk_gated_delta_rule`` against it on the same inputs instead. Both timed fwd+bwd in float32,
alternating runs, medians. Also times ``recurrent_efla`` against ``chunk_efla`` at [1, 4096, 4, 64].

Usage: python benchmarks/cpu_ops.py [--reps 5] [--out benchmarks/results_cpu_ops.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

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


def _time(fn, args):
    for x in args:
        x.grad = None
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


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


def _compare(op, shape, inp, ours, theirs, reps):
    err = _same_rule_difference(op, inp)
    _time(ours, inp)  # warm-up
    _time(theirs, inp)
    t_ours, t_hf = [], []
    for _ in range(reps):  # alternate the two
        t_ours.append(_time(ours, inp))
        t_hf.append(_time(theirs, inp))
    mo, mh = statistics.median(t_ours), statistics.median(t_hf)
    print(
        f"{op} {shape}: ours {mo * 1e3:.1f} ms, transformers {mh * 1e3:.1f} ms, speed-up {mh / mo:.2f}x, max rel diff {err:.1e}",
        flush=True,
    )
    return op, shape, mo, mh, mh / mo, err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--skip-recurrent", action="store_true")
    args = ap.parse_args(argv)

    rows = [_compare("chunk_efla", shape, _inputs(*shape), _fwd_bwd_efla, _fwd_bwd_hf, args.reps) for shape in SHAPES]
    rows += [
        _compare("chunk_gated_efla", shape, _gated_inputs(*shape), _fwd_bwd_gated, _fwd_bwd_hf_gated, args.reps)
        for shape in SHAPES
    ]

    rec_row = None
    if not args.skip_recurrent:
        inp = _inputs(1, 4096, 4, 64)
        _time(_fwd_bwd_efla, inp)
        tc, tr = [], []
        for _ in range(max(1, args.reps // 2)):
            tc.append(_time(_fwd_bwd_efla, inp))
            tr.append(_time(lambda *a: _fwd_bwd_efla(*a, fn=recurrent_efla), inp))
        mc, mr = statistics.median(tc), statistics.median(tr)
        rec_row = (mc, mr)
        print(f"[1, 4096, 4, 64]: recurrent_efla {mr * 1e3:.0f} ms vs chunk_efla {mc * 1e3:.0f} ms = {mr / mc:.1f}x", flush=True)

    lines = [
        f"### CPU, float32, fwd+bwd (`benchmarks/cpu_ops.py`, {datetime.date.today()})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}; "
        f"transformers {__import__('transformers').__version__}; medians of {args.reps} alternating runs.",
        "",
        "| op | [B, T, H, D] | ours | transformers `torch_chunk_gated_delta_rule` | speed-up | max rel. diff, same rule |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for op, shape, mo, mh, sp, err in rows:
        lines.append(f"| `{op}` | {list(shape)} | {mo * 1e3:.1f} ms | {mh * 1e3:.1f} ms | {sp:.2f}x | {err:.1e} |")
    lines += [
        "",
        "Baseline: `g = 0, beta = alpha` (the same recurrence) for `chunk_efla`; Gated DeltaNet with the same "
        "`g` and `beta` for `chunk_gated_efla` (its difference column: our `chunk_gated_delta_rule` vs it).",
    ]
    if rec_row:
        mc, mr = rec_row
        lines += [
            "",
            f"`recurrent_efla` fwd+bwd at [1, 4096, 4, 64]: {mr * 1e3:.0f} ms = {mr / mc:.1f}x `chunk_efla` ({mc * 1e3:.0f} ms).",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
