"""Context parallelism on real devices: one sequence split over the ranks against the single-process op.

    torchrun --nproc_per_node 2 benchmarks/context_parallel_check.py --dtype bfloat16 --tokens 16384

CUDA with NCCL when a GPU is visible (one per rank), else CPU with gloo. Every rank computes the
single-process op on the whole sequence and its own part through ``efla.distributed.context_parallel``.
Rank 0 prints one JSON line per case: the largest differences of the outputs, the final states and
the gradients of q, k, v, beta, g and the initial state, relative to the largest reference value
(the gradients of all ranks summed first), of the split against the single-process op and, for
bfloat16, of both against the single-process op in float32 (the split should be no worse).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from efla import environment, ops
from efla.distributed import context_parallel, shard, shard_layout


def _documents(T: int) -> tuple[int, ...]:
    """Boundaries off the part boundaries, with documents that span them."""
    return tuple(sorted({0, T // 8 + 3, T // 2 + 5, 3 * T // 4 + 1, T}))


def _inputs(rule, B, T, H, K, V, N, dtype, device, seed=0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(
        q=torch.nn.functional.normalize(rand(B, T, H, K), dim=-1),
        k=rand(B, T, H, K),
        v=rand(B, T, H, V),
        beta=torch.rand(B, T, H, generator=gen),
        h0=rand(N, H, K, V),
    )
    if "euler" in rule or rule.endswith("delta_rule"):
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    if rule.startswith("gated"):
        x["g"] = -0.1 * torch.rand(B, T, H, generator=gen)
    return {n: t.to(device, torch.float32 if n == "h0" else dtype).requires_grad_() for n, t in x.items()}


def _args(x, cut=lambda t: t):
    gate = [cut(x["g"])] if "g" in x else []
    return [cut(x["q"]), cut(x["k"]), cut(x["v"]), *gate, cut(x["beta"])]


def _final_rows(layout, n_rows):
    if layout.documents is None:
        return list(range(n_rows)) if layout.rank == layout.world_size - 1 else []
    return [i for i, end in enumerate(layout.local_offsets[1:]) if layout.start + end in layout.documents]


def _relative(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _single(op, rule, shape, dtype, cu, w_o, w_s):
    """The single-process op on the whole sequence: output, final states, gradients."""
    x = _inputs(rule, *shape, dtype, w_o.device)
    o, S = op(*_args(x), initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
    ((o.float() * w_o).sum() + (S * w_s).sum()).backward()
    return o.detach(), S.detach(), {n: t.grad for n, t in x.items()}


def _split(op, rule, shape, dtype, documents, w_o, w_s):
    """This rank's part through context_parallel; the gradients summed over the ranks."""
    x = _inputs(rule, *shape, dtype, w_o.device)
    T, N = shape[1], shape[-1]
    layout = shard_layout(T, dist.get_world_size(), dist.get_rank(), documents)
    o, S = context_parallel(
        op,
        *_args(x, lambda t: shard(t, layout)),
        layout=layout,
        initial_state=x["h0"][layout.document_rows],
        output_final_state=True,
    )
    rows = _final_rows(layout, S.shape[0])
    global_rows = torch.arange(N)[layout.document_rows][rows].tolist()
    ((o.float() * shard(w_o, layout)).sum() + (S[rows] * w_s[global_rows]).sum()).backward()
    grads = {}
    for n, t in x.items():
        grads[n] = torch.zeros_like(t, dtype=torch.float64) if t.grad is None else t.grad.double()
        dist.all_reduce(grads[n])
    return o.detach(), S.detach()[rows], grads, layout, global_rows


def _errors(o, S, grads, o_ref, S_ref, grads_ref) -> dict:
    errors = torch.tensor(
        [_relative(o, o_ref), _relative(S, S_ref) if S.numel() else 0.0]
        + [_relative(grads[n], grads_ref[n]) for n in sorted(grads)],
        dtype=torch.float64,
        device=o.device,
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    names = ["o", "final_state"] + [f"grad_{n}" for n in sorted(grads)]
    return dict(zip(names, [float(f"{e:.3g}") for e in errors.tolist()]))


def check(rule: str, documents, a, device) -> dict:
    """Errors of the split against the single-process op in the same dtype and, below float32,
    of both against the single-process op in float32."""
    op = getattr(ops, f"chunk_{rule}")
    B = 1 if documents is not None else a.batch
    N = B if documents is None else len(documents) - 1
    shape = (B, a.tokens, a.heads, a.head_dim, a.value_dim, N)
    cu = None if documents is None else torch.tensor(documents, dtype=torch.int32, device=device)
    dtype = getattr(torch, a.dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    w_o = torch.randn(B, a.tokens, a.heads, a.value_dim, generator=gen).to(device)
    w_s = torch.randn(N, a.heads, a.head_dim, a.value_dim, generator=gen).to(device)

    o_ref, S_ref, g_ref = _single(op, rule, shape, dtype, cu, w_o, w_s)
    o, S, grads, layout, rows = _split(op, rule, shape, dtype, documents, w_o, w_s)
    result = dict(split_vs_single=_errors(o, S, grads, shard(o_ref, layout), S_ref[rows], g_ref))
    if dtype.itemsize < 4:
        o32, S32, g32 = _single(op, rule, shape, torch.float32, cu, w_o, w_s)
        result["single_vs_float32"] = _errors(shard(o_ref, layout), S_ref[rows], g_ref, shard(o32, layout), S32[rows], g32)
        result["split_vs_float32"] = _errors(o, S, grads, shard(o32, layout), S32[rows], g32)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2, help="rows of the case without documents")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    p.add_argument("--rules", nargs="+", default=["efla", "gated_efla"])
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(environment.get("LOCAL_RANK"))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for rule in a.rules:
        for name, documents in [("rows", None), ("documents", _documents(a.tokens))]:
            result = check(rule, documents, a, device)
            if dist.get_rank() == 0:
                worst = {k: max(v.values()) for k, v in result.items()}
                print(
                    json.dumps(
                        dict(
                            rule=rule,
                            case=name,
                            world=dist.get_world_size(),
                            dtype=a.dtype,
                            tokens=a.tokens,
                            device=device.type,
                            backend=dist.get_backend(),
                            max_relative_error=worst,
                            **result,
                        )
                    ),
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
