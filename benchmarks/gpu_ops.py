"""GPU fast path of efla.ops: correctness against the CPU float64 reference, then timings.

One device call runs everything:

1. correctness (bf16 on the GPU vs float64 on the CPU through ``efla.ops.recurrent_*``): output,
   final state and the gradients of q, k, v, beta, g and the initial state, relative error
   ``||x - ref|| / ||ref||`` < 2e-2; stiff keys (``||k||^2`` log-uniform in [1e-2, 1e4]), varlen
   (one length-1 sequence), T not a multiple of 64, an initial state; no NaN anywhere. Also the
   fused recurrent (decode) kernel without autograd.
2. timings (``triton.testing.do_bench`` medians, methods measured alternately, median over rounds)
   of fwd and fwd+bwd for EFLA, Gated EFLA and, when flash-linear-attention is installed, its
   DeltaNet (``chunk_delta_rule(..., use_qk_l2norm_in_kernel=True)``) and Gated DeltaNet on the
   same inputs, at the six [B, T, H] shapes of the model benchmarks (K = V = 128, bf16); a decoding step at
   B = 32; and the model-level fwd+bwd tokens/s of the 340M preset stacks (exact vs euler).

Usage (on the GPU machine): ``python benchmarks/gpu_ops.py [--quick] [--out DIR]``.
Prints markdown tables and writes them to ``DIR/results_gpu.md`` (default ``$OUT`` or ``.``), and every
round's timing of ours and the baselines in the shape of ``benchmarks/evidence.py`` to
``DIR/gpu_ops_run.json`` (rewritten after every shape), the raw file for ``benchmarks/results/op_speed/``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as Fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import efla.ops as ops
from efla import environment
from efla.variants import Variant

T0 = time.time()
LINES: list[str] = []
RESULT_FILE: list[str] = []  # set in main(); the table file is rewritten after every line
BUDGET = [1e9]


def emit(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)
    if RESULT_FILE:
        with open(RESULT_FILE[0], "w") as fh:
            fh.write("\n".join(LINES) + "\n")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- inputs
def make_inputs(B, T, H, K, V, N, dev, dtype=torch.bfloat16, stiff=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen) / math.sqrt(K)
    if stiff:  # ||k||^2 log-uniform in [1e-2, 1e4]
        k = k * (10 ** (torch.rand(B, T, H, 1, generator=gen) * 3 - 1))
    else:
        k = Fn.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    g = Fn.logsigmoid(2 + 3 * torch.randn(B, T, H, generator=gen))  # log gate, down to ~ -12
    h0 = 0.5 * torch.randn(N, H, K, V, generator=gen)
    cast = lambda x: x.to(dev, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(beta), cast(g), h0.to(dev)


# ----------------------------------------------------------------------------- correctness
def check_correctness(dev, full=True, rules=("efla", "gated_efla", "delta_rule", "gated_delta_rule")) -> bool:
    emit("## Correctness (bf16 on GPU vs float64 CPU reference `efla.ops.recurrent_*`)")
    emit("")
    emit("relative error `||x - ref|| / ||ref||`; pass < 2e-2; stiff keys ||k||^2 in [1e-2, 1e4]")
    emit("")
    emit("| rule | case | mode | o | final state | dq | dk | dv | dbeta | dg | dh0 | max | ok |")
    emit("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    all_ok = True
    K = V = 128
    cases = [
        ("B=2 T=200 H=4", dict(B=2, T=200, H=4, cu=None)),
        ("varlen T=330 N=4 (lens 50,1,139,140)", dict(B=1, T=330, H=4, cu=[0, 50, 51, 190, 330])),
    ]
    if not full:  # H=16 shares the kernels' autotuning with the timing shapes (saves device time)
        cases = [("B=1 T=200 H=16", dict(B=1, T=200, H=16, cu=None))]
    for rule in rules:
        gated = Variant.parse(rule).gated
        for ci, (cname, c) in enumerate(cases):
            B, T, H, cu = c["B"], c["T"], c["H"], c["cu"]
            N = B if cu is None else len(cu) - 1
            # Euler rules diverge with stiff keys (that is the paper's point): unit keys there.
            q, k, v, beta, g, h0 = make_inputs(B, T, H, K, V, N, dev, stiff=rule.endswith("efla"), seed=10 + ci)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev) if cu is not None else None
            names = ["q", "k", "v", "beta"] + (["g"] if gated else []) + ["h0"]
            xs = [q, k, v, beta] + ([g] if gated else []) + [h0]
            gen = torch.Generator().manual_seed(99)
            do = torch.randn(B, T, H, V, generator=gen)
            dht = torch.randn(N, H, K, V, generator=gen)

            def call(fn, xs, cu_):
                if gated:
                    a = (xs[0], xs[1], xs[2], xs[4], xs[3])
                else:
                    a = (xs[0], xs[1], xs[2], xs[3])
                return fn(*a, initial_state=xs[-1], output_final_state=True, cu_seqlens=cu_)

            # float64 reference on the CPU, from the same (bf16-rounded) inputs
            rx = [x.detach().cpu().double().requires_grad_() for x in xs]
            ro, rht = call(getattr(ops, "recurrent_" + rule), rx, torch.tensor(cu) if cu is not None else None)
            rgr = torch.autograd.grad((ro * do.double()).sum() + (rht * dht.double()).sum(), rx)
            rg = dict(zip(names, rgr))

            # GPU chunk path with autograd
            gx = [x.detach().clone().requires_grad_() for x in xs]
            o, ht = call(getattr(ops, "chunk_" + rule), gx, cu_t)
            loss = (o.float() * do.to(dev)).sum() + (ht * dht.to(dev)).sum()
            grads = dict(zip(names, torch.autograd.grad(loss, gx)))
            errs = {"o": rel(o, ro), "ht": rel(ht, rht)}
            for n in ["q", "k", "v", "beta", "g", "h0"]:
                errs["d" + n] = rel(grads[n], rg[n]) if n in grads else None
            mx = max(e if e == e else 1e9 for e in errs.values() if e is not None)
            ok = mx < 2e-2
            all_ok &= ok
            f = lambda e: "-" if e is None else f"{e:.1e}"  # noqa: E731
            emit(
                f"| {rule} | {cname} | chunk+bwd | "
                + " | ".join(f(errs[x]) for x in ["o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0"])
                + f" | {mx:.1e} | {'yes' if ok else 'NO'} |"
            )

            # fused recurrent (decode) kernel, no autograd
            with torch.no_grad():
                o2, ht2 = call(getattr(ops, "recurrent_" + rule), [x.detach() for x in xs], cu_t)
            e2 = {"o": rel(o2, ro), "ht": rel(ht2, rht)}
            mx2 = max(e if e == e else 1e9 for e in e2.values())
            ok2 = mx2 < 2e-2
            all_ok &= ok2
            emit(
                f"| {rule} | {cname} | recurrent | {e2['o']:.1e} | {e2['ht']:.1e} | - | - | - | - | - | - "
                f"| {mx2:.1e} | {'yes' if ok2 else 'NO'} |"
            )
    emit("")
    emit(f"correctness: {'ALL PASS' if all_ok else 'FAILURES'} ({time.time() - T0:.0f}s)")
    emit("")
    return all_ok


# ----------------------------------------------------------------------------- timing
REP = [40.0]


def bench_alternating(fns: dict, rounds: int, warmup=10, rep=None) -> dict[str, list[float]]:
    """Each method's ``do_bench`` median per round, the methods taking turns within a round."""
    from triton.testing import do_bench

    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            if f is None:
                continue
            res[n].append(do_bench(f, warmup=warmup, rep=rep or REP[0], return_mode="median"))
    return res


def medians(per_round: dict[str, list[float]]) -> dict:
    return {n: (statistics.median(v) if v else None) for n, v in per_round.items()}


# ----------------------------------------------------------------------------- the raw record
RECORD: dict = {"path": None, "rounds": 0, "title": "", "measurements": [], "notes": []}


def compared(case: str, metric: str, per_round: dict, ours: tuple[str, str], baseline: tuple[str, str]) -> list[dict]:
    """``ours`` against ``baseline`` (``(label, key in per_round)``) when both kept every round."""
    from evidence import measurement

    a, b = per_round.get(ours[1]), per_round.get(baseline[1])
    if not a or not b or len(a) != len(b):
        return []
    return [measurement(case, metric, "ms", "lower", (ours[0], a), (baseline[0], b))]


def chunk_measurements(case: str, tf: dict, tb: dict, variants) -> list[dict]:
    """One shape's chunk timings (per round) as measurements: our ops against fla's, and each variant
    against fla's and against our default path."""
    fwd, both = "forward time", "forward and backward time"
    dn, gdn, gdn_ours = (
        ("fla DeltaNet", "dn"),
        ("fla Gated DeltaNet", "gdn"),
        ("Gated DeltaNet (fla's kernels through our code)", "gdn_ours"),
    )
    found = compared(case, fwd, tf, ("EFLA", "efla"), dn) + compared(case, both, tb, ("EFLA", "efla"), dn)
    found += compared(case, fwd, tf, ("Gated EFLA", "gefla"), gdn) + compared(case, both, tb, ("Gated EFLA", "gefla"), gdn)
    found += compared(case, both, tb, ("Gated EFLA", "gefla"), gdn_ours)
    for name in variants:
        settings = " ".join(f"{k}={v}" for k, v in VARIANTS[name][1].items())
        for op, key, base in (("EFLA", "efla", dn), ("Gated EFLA", "gefla", gdn)):
            ours = (f"{op}, {settings}", f"{key}_{name}")
            found += compared(case, fwd, tf, ours, base) + compared(case, fwd, tf, ours, (op, key))
            found += compared(case, both, tb, ours, base) + compared(case, both, tb, ours, (op, key))
    if tb.get("floor"):
        from evidence import measurement

        found.append(measurement(case, both, "ms", "lower", ("fla chunk_delta_rule kernel alone (floor)", tb["floor"]), None))
    return found


def write_record(found: list[dict]) -> None:
    """Adds ``found`` to the run and rewrites ``DIR/gpu_ops_run.json`` (a call cut short keeps what it had)."""
    from evidence import write_run

    RECORD["measurements"] += found
    if RECORD["path"] and RECORD["measurements"]:
        write_run(RECORD["path"], "gpu_ops", RECORD["title"], RECORD["rounds"], RECORD["measurements"], RECORD["notes"])


def try_call(f):
    try:
        f()
        torch.cuda.synchronize()
        return f, None
    except Exception as e:
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def with_settings(f, settings: dict):
    """``f`` run with ``settings``, efla's switches by name (``efla.environment.override``)."""

    def run():
        with environment.override(**settings):
            return f()

    return run


def with_triton_launches(f):
    """``f`` with every launch of ours through Triton's own launch path (the control for the
    default, which sends launches after the first straight to the compiled kernel)."""
    return with_settings(f, {"EFLA_DIRECT_LAUNCH": "0"})


# our ops once more under other settings, timed in the same rounds: (what the table says, settings)
VARIANTS = {
    "triton": ("Control: our ops with every launch through Triton, `EFLA_DIRECT_LAUNCH=0`", {"EFLA_DIRECT_LAUNCH": "0"}),
    "tuned": (
        "Our ops with the state passes tuned per batch x heads, `EFLA_STATE_TUNING=1`",
        {"EFLA_STATE_TUNING": "1"},
    ),
    "fusedfwd": (
        "Our ops with the forward's state and output passes in one kernel, `EFLA_FUSED_FORWARD=1`",
        {"EFLA_FUSED_FORWARD": "1"},
    ),
    # fla's state passes are tuned per head count only, so the whole and the split passes would share
    # one setting: the split variants tune per sequences x heads, to be read against `tuned`
    "split4": (
        "Our ops with the state passes over sequences in 4 pieces side by side, tuned per sequences x heads, "
        "`EFLA_SPLIT_STATE=4 EFLA_STATE_TUNING=1` (against the `tuned` rows)",
        {"EFLA_SPLIT_STATE": "4", "EFLA_STATE_TUNING": "1"},
    ),
    "split8": (
        "The same in 8 pieces, `EFLA_SPLIT_STATE=8 EFLA_STATE_TUNING=1`",
        {"EFLA_SPLIT_STATE": "8", "EFLA_STATE_TUNING": "1"},
    ),
}


def variant_table_lines(variant_rows: dict) -> list[str]:
    lines = []
    for name, rows in variant_rows.items():
        lines += ["", f"{VARIANTS[name][0]} (timed in the same rounds as the first table; ratios to its fla columns):", ""]
        lines.append(
            "| [B, T, H] | EFLA fwd | vs DeltaNet | EFLA fwd+bwd | vs DeltaNet | Gated EFLA fwd | vs GDN | Gated EFLA fwd+bwd |"
        )
        lines.append("|" + " --- |" * 8)
        lines += rows
    return lines


def write_lines(lines: list[str], name: str) -> None:
    if RESULT_FILE and lines:
        with open(os.path.join(os.path.dirname(RESULT_FILE[0]), name), "w") as fh:
            fh.write("\n".join(LINES[:8] + lines) + "\n")


def timing(dev, shapes, rounds, fla_ok, dims=((128, 128),), variants=tuple(VARIANTS)):
    dims_text = "K = V = 128" if dims == ((128, 128),) else "head dims K, V as given"
    emit(
        f"## Chunk timings (ms, medians; {dims_text}, bf16; the layers' calls: fla DeltaNet/GDN with "
        "`use_qk_l2norm_in_kernel=True`, EFLA/Gated EFLA with `use_q_l2norm_in_kernel=True`, gates in float32)"
    )
    emit("")
    if fla_ok:
        from fla.ops.delta_rule import chunk_delta_rule as fla_dn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    hdr = (
        "| [B, T, H] | DeltaNet fwd | EFLA fwd | ratio | DeltaNet fwd+bwd | EFLA fwd+bwd | ratio "
        "| fla kernel alone fwd+bwd (floor) | GDN fwd | Gated EFLA fwd | ratio | GDN fwd+bwd (fla) "
        "| GDN fwd+bwd (ours) | Gated EFLA fwd+bwd | vs EFLA | vs GDN (ours) |"
    )
    emit(hdr)
    emit("|" + " --- |" * (hdr.count("|") - 1))
    notes, variant_rows = [], {name: [] for name in variants}
    for (B, T, H), (K, V) in ((sh, d) for d in dims for sh in shapes):
        label = f"{B}, {T}, {H}" + ("" if (K, V) == (128, 128) else f"; K={K}, V={V}")
        if time.time() - T0 > BUDGET[0]:
            emit(f"| {label} | skipped (time budget) |")
            continue
        q, k, v, beta, g, _ = make_inputs(B, T, H, K, V, B, dev, stiff=True, seed=1)
        qn, kn = q, k  # DeltaNet normalises inside (use_qk_l2norm_in_kernel=True)
        do = torch.randn_like(v)
        leaves = [x.requires_grad_() for x in (q, k, v, beta, g)]

        def fb(fwd):
            def run():
                o = fwd()[0]
                o.backward(do)

            return run

        def gnone():
            for x in leaves:
                x.grad = None

        # the calls the layers make: fla normalises q and k in its kernels, EFLA normalises q in its
        # (keys stay raw); the gate in float32, as fla's layers produce it
        g32 = g.detach().float().requires_grad_()
        leaves.append(g32)
        fwd = {
            "dn": (lambda: fla_dn(qn, kn, v, beta, use_qk_l2norm_in_kernel=True)) if fla_ok else None,
            "efla": lambda: ops.chunk_efla(q, k, v, beta, use_q_l2norm_in_kernel=True),
            "gdn": (lambda: fla_gdn(qn, kn, v, g32, beta, use_qk_l2norm_in_kernel=True)) if fla_ok else None,
            "gefla": lambda: ops.chunk_gated_efla(q, k, v, g32, beta, use_q_l2norm_in_kernel=True),
        }
        for name in variants:
            settings = VARIANTS[name][1]
            fwd[f"efla_{name}"] = with_settings(fwd["efla"], settings)
            fwd[f"gefla_{name}"] = with_settings(fwd["gefla"], settings)
        fwdbwd = {
            "dn": fb(fwd["dn"]) if fla_ok else None,
            "efla": fb(fwd["efla"]),
            "floor": fb(lambda: fla_dn(q, k, v, beta)) if fla_ok else None,
            "gdn": fb(fwd["gdn"]) if fla_ok else None,
            "gdn_ours": fb(lambda: ops.chunk_gated_delta_rule(q, k, v, g32, beta, use_qk_l2norm_in_kernel=True)),
            "gefla": fb(fwd["gefla"]),
            **{f"{op}_{name}": fb(fwd[f"{op}_{name}"]) for name in variants for op in ("efla", "gefla")},
        }
        with torch.no_grad():
            fwd_ok = {}
            for n, f in fwd.items():
                fwd_ok[n], err = try_call(f) if f is not None else (None, "fla missing")
                if err:
                    notes.append(f"({label}) fwd {n}: {err}")
        fb_ok = {}
        for n, f in fwdbwd.items():
            fb_ok[n], err = try_call(f) if f is not None else (None, "fla missing")
            gnone()
            if err:
                notes.append(f"({label}) fwd+bwd {n}: {err}")
        with torch.no_grad():
            tf_rounds = bench_alternating(fwd_ok, rounds)
        tb_rounds = bench_alternating({n: (lambda f=f: (f(), gnone())) if f else None for n, f in fb_ok.items()}, rounds)
        tf, tb = medians(tf_rounds), medians(tb_rounds)
        write_record(chunk_measurements(f"[{label}]", tf_rounds, tb_rounds, variants))

        def r(a, b):
            return f"{a / b:.2f}x" if a and b else "-"

        def m(x):
            return f"{x:.3f}" if x else "n/a"

        emit(
            f"| {label} | {m(tf['dn'])} | {m(tf['efla'])} | {r(tf['efla'], tf['dn'])} | {m(tb['dn'])} "
            f"| {m(tb['efla'])} | {r(tb['efla'], tb['dn'])} | {m(tb['floor'])} | {m(tf['gdn'])} "
            f"| {m(tf['gefla'])} | {r(tf['gefla'], tf['gdn'])} | {m(tb['gdn'])} | {m(tb['gdn_ours'])} "
            f"| {m(tb['gefla'])} | {r(tb['gefla'], tb['efla'])} | {r(tb['gefla'], tb['gdn_ours'])} |"
        )
        for name, rows in variant_rows.items():
            e, ge = f"efla_{name}", f"gefla_{name}"
            rows.append(
                f"| {label} | {m(tf[e])} | {r(tf[e], tf['dn'])} | {m(tb[e])} | {r(tb[e], tb['dn'])} "
                f"| {m(tf[ge])} | {r(tf[ge], tf['gdn'])} | {m(tb[ge])} |"
            )
        fwd = fwdbwd = fwd_ok = fb_ok = None  # free this shape's tensors before the next
        torch.cuda.empty_cache()
        # a call cut short at its time limit still brings back every shape finished so far
        write_lines(variant_table_lines(variant_rows), "variants_so_far.md")
    for line in variant_table_lines(variant_rows):
        emit(line)
    emit("")
    for n in dict.fromkeys(notes):
        emit(f"- note: {n}")
    emit("")
    RECORD["notes"] += list(dict.fromkeys(notes))
    write_record([])


def decode_timing(dev, rounds, fla_ok):
    emit("## Decode step (ms, medians; B = 32, H = 16, K = V = 128, T = 1, bf16, fp32 state in/out)")
    emit("")
    B, H, K, V = 32, 16, 128, 128
    q, k, v, beta, g, h0 = make_inputs(B, 1, H, K, V, B, dev, stiff=True, seed=2)
    fns = {}
    if fla_ok:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        fns["DeltaNet (fla fused_recurrent, l2norm)"] = lambda: fused_recurrent_delta_rule(
            q, k, v, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    fns["EFLA (efla.ops.recurrent_efla)"] = lambda: ops.recurrent_efla(q, k, v, beta, initial_state=h0, output_final_state=True)
    if fla_ok:
        fns["Gated DeltaNet (fla fused_recurrent, l2norm)"] = lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g.float(), beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    fns["Gated EFLA (efla.ops.recurrent_gated_efla)"] = lambda: ops.recurrent_gated_efla(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    with torch.no_grad():
        ok = {}
        for n, f in fns.items():
            ok[n], err = try_call(f)
            if err:
                emit(f"- note: {n}: {err}")
        per_round = bench_alternating(ok, rounds, warmup=25, rep=2 * REP[0])
        t = medians(per_round)
    case = f"decode step, B = {B}, H = {H}, K = V = {K}"
    pairs = zip(list(per_round)[1::2], list(per_round)[::2]) if fla_ok else ()  # (ours, fla's) in the order above
    write_record([m for ours, fla in pairs for m in compared(case, "time", per_round, (ours, ours), (fla, fla))])
    emit("| method | ms | ratio |")
    emit("| --- | --- | --- |")
    names = list(t)
    for i, n in enumerate(names):
        base = t[names[i - 1]] if (i % 2 == 1 and fla_ok) else None
        emit(f"| {n} | {t[n]:.4f} | {(f'{t[n] / base:.2f}x' if base and t[n] else '-')} |" if t[n] else f"| {n} | n/a | - |")
    emit("")


def model_timing(dev, budget_s, rounds):
    emit("## Model level: 340M preset, fwd+bwd tokens/s (bf16 weights, B = 8, T = 2048)")
    emit("")
    try:
        from efla.models import EFLAForCausalLM, get_preset_config
    except Exception as e:
        emit(f"- skipped: efla.models not importable ({type(e).__name__}: {e})")
        emit("")
        return
    B, T = 8, 2048
    emit("| preset | ms / step | tokens/s | ratio |")
    emit("| --- | --- | --- | --- |")
    pairs = [("340m-efla", "340m-deltanet"), ("340m-gated-efla", "340m-gated-deltanet")]
    for pair in pairs:
        if time.time() - T0 > budget_s + 60:
            emit(f"| {pair} | skipped (time) | | |")
            continue
        models, res = {}, {}
        try:
            for name in pair:
                torch.manual_seed(0)
                models[name] = EFLAForCausalLM(get_preset_config(name)).to(dev, torch.bfloat16)
            ids = torch.randint(0, 32000, (B, T), device=dev)
            steps = {}
            for name, mdl in models.items():

                def step(mdl=mdl):
                    out = mdl(input_ids=ids, labels=ids)
                    out.loss.backward()
                    mdl.zero_grad(set_to_none=True)

                step()
                torch.cuda.synchronize()
                steps[name] = step
            times = {n: [] for n in steps}
            for _ in range(rounds):
                for n, s in steps.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        s()
                    torch.cuda.synchronize()
                    times[n].append((time.perf_counter() - t0) / 3)
            for n in pair:
                res[n] = statistics.median(times[n])
            ms_rounds = {n: [1e3 * s for s in v] for n, v in times.items()}
            write_record(
                compared(
                    f"{pair[0]} against {pair[1]}, B = {B}, T = {T}",
                    "fwd+bwd step time",
                    ms_rounds,
                    (pair[0], pair[0]),
                    (pair[1], pair[1]),
                )
            )
            base = res[pair[1]]
            for n in pair:
                emit(f"| {n} | {res[n] * 1e3:.1f} | {B * T / res[n]:,.0f} | {res[n] / base:.3f}x |")
        except Exception as e:
            emit(f"| {pair} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |")
            traceback.print_exc()
        del models
        torch.cuda.empty_cache()
    emit("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, one round (smoke test)")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--shapes", default=None, help="chunk-timing shapes 'B,T,H;B,T,H' (default: the six [B, T, H] shapes)")
    ap.add_argument("--head-dims", default="128x128", help="chunk-timing head dims 'KxV,KxV'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"our ops under other settings, timed in the same rounds (comma-separated of {', '.join(VARIANTS)}; '' for none)",
    )
    ap.add_argument("--quick-correctness", action="store_true", help="one non-varlen case at H=16")
    ap.add_argument("--rules", default="efla,gated_efla,delta_rule,gated_delta_rule")
    ap.add_argument("--rep", type=float, default=40.0, help="do_bench rep (ms)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds after which optional stages are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    unknown = [name for name in args.variants.split(",") if name and name not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    os.makedirs(args.out, exist_ok=True)
    RESULT_FILE.append(os.path.join(args.out, "results_gpu.md"))
    BUDGET[0] = args.budget
    REP[0] = args.rep
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do")
        return 0
    dev = torch.device("cuda")
    import triton
    from efla.ops.cuda.launch import direct_launches

    from efla.ops import cuda as backend

    fla_ok = backend.fla_available()
    try:
        import fla

        fla_v = getattr(fla, "__version__", "?")
    except Exception:
        fla_v = "not installed"
    emit("# efla GPU ops: correctness and speed")
    emit("")
    emit(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    emit(f"- GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    emit(f"- torch {torch.__version__}, triton {triton.__version__}, flash-linear-attention {fla_v}, CUDA {torch.version.cuda}")
    emit(f"- timings: `triton.testing.do_bench` medians; methods measured alternately, median over {args.rounds} rounds")
    direct = direct_launches()
    how = "straight to the compiled kernel" if direct else "through Triton"
    emit(f"- our launches after the first: {how} (EFLA_DIRECT_LAUNCH={int(direct)})")
    emit("")
    ok = True
    try:
        if not args.skip_correctness:
            ok = check_correctness(dev, full=not args.quick_correctness, rules=tuple(args.rules.split(",")))
    except Exception:
        traceback.print_exc()
        emit("correctness stage crashed (see log)")
        ok = False
    # H = 96 last: it re-autotunes fla's kernels (H is in their autotune keys)
    shapes = [(8, 2048, 16), (4, 4096, 16), (2, 8192, 16), (1, 16384, 16), (2, 16384, 16), (1, 8192, 96)]
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    if args.quick:
        shapes = shapes[:1]
    dims = tuple(tuple(int(x) for x in d.split("x")) for d in args.head_dims.split(","))
    variants = tuple(name for name in args.variants.split(",") if name)
    rounds = 1 if args.quick else args.rounds
    RECORD.update(
        path=os.path.join(args.out, "gpu_ops_run.json"),
        rounds=rounds,
        title=f"Ops at {len(shapes)} shapes" + ("" if dims == ((128, 128),) else f", head dims {args.head_dims}"),
        notes=[
            f"do_bench medians (rep {args.rep} ms), the methods taking turns within each of {rounds} rounds",
            f"our launches after the first: {how} (EFLA_DIRECT_LAUNCH={int(direct)})",
        ],
    )
    # the model stage runs before the chunk timings: the H = 96 shape's autotuning is the slowest part
    for stage in (
        (None if args.skip_decode else lambda: decode_timing(dev, rounds, fla_ok)),
        (None if args.skip_model else lambda: model_timing(dev, args.budget, rounds)),
        lambda: timing(dev, shapes, rounds, fla_ok, dims, variants),
    ):
        if stage is None:
            continue
        try:
            stage()
        except Exception:
            traceback.print_exc()
            emit("stage crashed (see log)")
        emit(f"(elapsed {time.time() - T0:.0f}s)")
        emit("")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
