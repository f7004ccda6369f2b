"""Context-parallel ops equal the single-process op: outputs, final states and every gradient."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from efla import ops
from efla.ops import deferred_key_checks
from efla.ops.cuda.key_checks import defer_key_check
from efla.distributed import context_parallel, conv_histories, shard, shard_layout
from efla.layers.modules import ShortConvolution

from .spawn import run_in_processes

H, K, V = 2, 8, 6
TOL = 1e-10

# (name, batch, tokens, document offsets); with 2 and 4 ranks the 40 tokens split at 20 (and 10, 30)
LAYOUTS = [
    ("batch", 2, 24, None),
    ("spanning", 1, 40, (0, 7, 31, 40)),  # [7, 31) spans every rank
    ("aligned", 1, 40, (0, 3, 20, 27, 30, 37, 40)),  # boundaries on part boundaries, several per part
    ("short-first", 1, 40, (0, 9, 11, 40)),  # a 2-token document, then one that spans parts
    ("tiny-parts", 1, 10, (0, 6, 10)),  # parts of 2-5 tokens: shorter than the convolution
    ("batch-tiny", 2, 9, None),
]
OPS = [f"chunk_{rule}" for rule in ("efla", "gated_efla", "delta_rule", "gated_delta_rule")] + [
    "recurrent_efla",
    "recurrent_gated_efla",
]
CONV_WIDTH = 4
LOW_PRECISION = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to the largest reference value


def _inputs(rule: str, B: int, T: int, N: int, seed: int, dtype=torch.float64, groups: int = 1) -> dict:
    """Op inputs with ``groups * H`` value heads (grouped values when ``groups > 1``)."""
    gen = torch.Generator().manual_seed(seed)
    HV = groups * H

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = rand(B, T, H, K)
    if "efla" not in rule:  # the Euler rules are stable only with unit keys
        k = torch.nn.functional.normalize(k, dim=-1)
    x = dict(
        q=rand(B, T, H, K),
        k=k,
        v=rand(B, T, HV, V),
        beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
        h0=rand(N, HV, K, V),
    )
    if rule.startswith("gated"):
        x["g"] = -torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {name: t.to(state_dtype if name == "h0" else dtype).requires_grad_() for name, t in x.items()}


def _op_args(x: dict, cut=lambda t: t) -> list:
    gate = [cut(x["g"])] if "g" in x else []
    return [cut(x["q"]), cut(x["k"]), cut(x["v"]), *gate, cut(x["beta"])]


def _weights(o_shape, s_shape, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(*o_shape, generator=gen, dtype=torch.float64), torch.randn(*s_shape, generator=gen, dtype=torch.float64))


def _reference(op, x, documents, seed):
    cu = None if documents is None else torch.tensor(documents, dtype=torch.int32)
    o, S = op(*_op_args(x), initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
    w_o, w_s = _weights(o.shape, S.shape, seed)
    ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
    return o.detach(), S.detach(), {n: t.grad.clone() for n, t in x.items()}


def _final_rows(layout, n_rows: int) -> list[int]:
    """Local state rows that are a document's final state (the document ends on this rank)."""
    if layout.documents is None:
        return list(range(n_rows)) if layout.rank == layout.world_size - 1 else []
    ends_here = [layout.start + end in layout.documents for end in layout.local_offsets[1:]]
    return [i for i, e in enumerate(ends_here) if e]


def _split_run(op, x, layout, seed):
    o, S = context_parallel(
        op,
        *_op_args(x, lambda t: shard(t, layout)),
        layout=layout,
        initial_state=x["h0"][layout.document_rows],
        output_final_state=True,
    )
    w_o, w_s = _weights((x["v"].shape), (x["h0"].shape), seed)
    rows = _final_rows(layout, S.shape[0])
    global_rows = torch.arange(x["h0"].shape[0])[layout.document_rows][rows]
    loss = (o.double() * shard(w_o, layout)).sum() + (S[rows].double() * w_s[global_rows]).sum()
    loss.backward()
    return o.detach(), S.detach()[rows], global_rows


def _max_error(a: torch.Tensor, b: torch.Tensor, relative: bool) -> torch.Tensor:
    error = (a.double() - b.double()).abs().max()
    return error / b.double().abs().max() if relative else error


def _case_errors(
    op_name: str, name: str, B: int, T: int, documents, rank: int, world: int, dtype=torch.float64, groups: int = 1
) -> dict:
    """Largest differences to the single-process op: absolute in float64, relative to the largest
    reference value in lower precision."""
    op = getattr(ops, op_name)
    rule = op_name.split("_", 1)[1]
    N = B if documents is None else len(documents) - 1
    seed = zlib.crc32(f"{op_name}/{name}".encode()) % 10_000
    relative = dtype != torch.float64
    o_ref, S_ref, g_ref = _reference(op, _inputs(rule, B, T, N, seed, dtype, groups), documents, seed)
    x = _inputs(rule, B, T, N, seed, dtype, groups)
    layout = shard_layout(T, world, rank, documents)
    o, S, rows = _split_run(op, x, layout, seed)
    errors = torch.zeros(3 + len(x), dtype=torch.float64)
    errors[0] = _max_error(o, shard(o_ref, layout), relative)
    errors[1] = _max_error(S, S_ref[rows], relative) if len(rows) else 0.0
    covered = torch.zeros(N)
    covered[rows] = 1
    dist.all_reduce(covered)  # every document's final state is checked on exactly one rank
    errors[2] = (covered - 1).abs().max()
    for i, (n, t) in enumerate(sorted(x.items())):
        grad = torch.zeros_like(t, dtype=torch.float64) if t.grad is None else t.grad.double()
        dist.all_reduce(grad)  # each rank holds the gradient of its own part
        errors[3 + i] = _max_error(grad, g_ref[n], relative)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    labels = ["o", "final_state", "final_state_coverage"] + [f"grad_{n}" for n in sorted(x)]
    return dict(zip(labels, errors.tolist()))


def _convolutions(widths, seed: int) -> list:
    torch.manual_seed(seed)
    return [ShortConvolution(d, CONV_WIDTH, bias=True).double() for d in widths]


def _conv_errors(name: str, B: int, T: int, documents, rank: int, world: int) -> dict:
    """Short convolutions of each part, continued by :func:`conv_histories`, against the full sequence."""
    widths, seed = (5, 3), zlib.crc32(name.encode())
    cu = None if documents is None else torch.tensor(documents, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, T, d, generator=gen, dtype=torch.float64, requires_grad=True) for d in widths]
    ws = [torch.randn(B, T, d, generator=gen, dtype=torch.float64) for d in widths]
    convs = _convolutions(widths, seed)
    sum((c(x, cu_seqlens=cu)[0] * w).sum() for c, x, w in zip(convs, xs, ws)).backward()
    reference = [t.grad.clone() for t in (*xs, *(p for c in convs for p in c.parameters()))]
    outputs_ref = [c(x, cu_seqlens=cu)[0].detach() for c, x in zip(convs, xs)]

    layout = shard_layout(T, world, rank, documents)
    xs_split = [x.detach().clone().requires_grad_() for x in xs]
    convs = _convolutions(widths, seed)
    parts = [shard(x, layout) for x in xs_split]
    caches = conv_histories(parts, CONV_WIDTH, layout)
    outs = [c(p, cache=h, cu_seqlens=layout.local_cu_seqlens())[0] for c, p, h in zip(convs, parts, caches)]
    sum((o * shard(w, layout)).sum() for o, w in zip(outs, ws)).backward()
    errors = torch.tensor(
        [max((o.detach() - shard(r, layout)).abs().max() for o, r in zip(outs, outputs_ref)), 0.0], dtype=torch.float64
    )
    for t, ref in zip((*xs_split, *(p for c in convs for p in c.parameters())), reference):
        grad = t.grad.clone()
        dist.all_reduce(grad)
        errors[1] = max(errors[1], (grad - ref).abs().max())
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return dict(zip(["conv_output", "conv_grads"], errors.tolist()))


def _flagging_on_rank(rank: int, flagging_rank: int):
    """``chunk_efla`` as it acts on a GPU whose coefficient pass flagged an overflowing key on one
    rank: the flag goes to an enclosing ``deferred_key_checks()`` if one takes it, else it raises."""

    def op(*args, **kwargs):
        if rank == flagging_rank and not defer_key_check(torch.ones(1, dtype=torch.int32)):
            raise ValueError("k: a key's squared norm ||k||^2 overflows float32")
        return ops.chunk_efla(*args, **kwargs)

    return op


def _refusals(rank: int, world: int) -> dict:
    """Inputs that do not fit the layout are refused on every rank before any exchange (0: refused
    on every rank; 1: some rank went on)."""
    documents = (0, 7, 31, 40)
    layout = shard_layout(40, world, rank, documents)
    x = _inputs("efla", 1, layout.length + 1, 3, seed=0)
    fitting = _op_args(x, lambda t: t[:, :-1])
    other_offsets = (0, layout.length) if len(layout.local_offsets) > 2 else (0, 1, layout.length)
    efla = ops.chunk_efla
    cases = {
        "too many tokens": (efla, _op_args(x), {}),
        "other offsets": (efla, fitting, {"cu_seqlens": torch.tensor(other_offsets, dtype=torch.int32)}),
        "other rank": (efla, fitting, {"layout": shard_layout(40, world, (rank + 1) % world, documents)}),
        # rank 0's keys overflow float64's ||k||^2: every rank raises (none waits in the exchange)
        "keys refused on rank 0": (efla, [t * 1e155 if i == 1 and rank == 0 else t for i, t in enumerate(fitting)], {}),
        # ... also where a model reads its layers' flags once per forward: the call itself raises
        "GPU flag on rank 0 in a model's block": (_flagging_on_rank(rank, 0), fitting, {}),
    }
    went_on = torch.zeros(len(cases))
    for i, (op, args, kwargs) in enumerate(cases.values()):
        try:
            with deferred_key_checks():
                context_parallel(op, *args, **{"layout": layout, **kwargs})
            went_on[i] = 1.0
        except ValueError:
            pass
    dist.all_reduce(went_on, op=dist.ReduceOp.MAX)
    return dict(zip(cases, went_on.tolist()))


def compare_all(rank: int, world: int) -> dict:
    errors = {"refusals": _refusals(rank, world)}
    errors.update(
        {
            f"{op}/{name}@{str(dtype)[6:]}": _case_errors(op, name, B, T, docs, rank, world, dtype)
            for dtype in LOW_PRECISION
            for op in ("chunk_efla", "chunk_gated_efla")
            for name, B, T, docs in LAYOUTS[:2]
        }
    )
    errors.update({f"{op}/{name}": _case_errors(op, name, B, T, docs, rank, world) for op in OPS for name, B, T, docs in LAYOUTS})
    errors.update(
        {
            f"{op}/{name}/grouped-values": _case_errors(op, name, B, T, docs, rank, world, groups=2)
            for op in ("chunk_efla", "chunk_gated_efla")
            for name, B, T, docs in LAYOUTS[:2]
        }
    )
    errors.update({f"conv/{name}": _conv_errors(name, B, T, docs, rank, world) for name, B, T, docs in LAYOUTS})
    return errors


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_context_parallel_matches_single_process(world, tmp_path):
    errors = run_in_processes(compare_all, world, tmp_path)[0]
    tolerances = {case: LOW_PRECISION[getattr(torch, case.split("@")[1])] if "@" in case else TOL for case in errors}
    worst = {case: max(e.values()) for case, e in errors.items()}
    bad = {case: errors[case] for case, w in worst.items() if not w < tolerances[case]}
    assert not bad, f"errors above the tolerances: {bad}"
    for dtype, tolerance in [("float64", TOL), *((str(d)[6:], t) for d, t in LOW_PRECISION.items())]:
        print(f"world {world}, {dtype}: max error {max(w for c, w in worst.items() if tolerances[c] == tolerance):.2e}")
