"""Fused GPU modules against the PyTorch modules they replace, forward and backward.

Shared by the CUDA tests (``test_fused.py``) and by the same checks run on the CPU under Triton's
interpreter (a subprocess that calls :func:`main`). Each check returns the relative errors of the
outputs, the input gradients and the parameter gradients of the fused path against the PyTorch
path on the same inputs.
"""

from __future__ import annotations

import builtins
import math
import sys

import torch

from efla.layers import fla_kernels as fused
from efla.layers.modules import GatedMLP, RMSNorm, RMSNormGated, ShortConvolution, decay_gate


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _run(module, inputs, kwargs):
    for p in module.parameters():
        p.grad = None
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = module(*leaves, **kwargs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    weights = [torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o) for o in outs]
    sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs] + [x.grad for x in leaves] + [p.grad.clone() for p in module.parameters()]


def compare(module, inputs, kwargs=None, allow_cpu=False) -> list[float]:
    """Relative errors (fused vs PyTorch) of every output and gradient."""
    kwargs = kwargs or {}
    before = fused._allow_cpu
    fused._allow_cpu = allow_cpu
    try:
        assert fused.kernels_for(inputs[0]) is not None, "fused kernels unavailable for this input"
        got = _run(module, inputs, kwargs)
    finally:
        fused._allow_cpu = before
    with fused.disabled():
        ref = _run(module, inputs, kwargs)
    assert len(got) == len(ref)
    return [rel(a, b) for a, b in zip(got, ref)]


class _PreNorm(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        return self.norm(x, residual, prenorm=True)


class _DecayGate(torch.nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1, 16, heads)))
        self.dt_bias = torch.nn.Parameter(torch.linspace(-6, 2, heads))

    def forward(self, a):
        return decay_gate(a, self.A_log, self.dt_bias)


class _SliceConv(torch.nn.Module):
    """A short convolution of the middle third of its input: a strided view, as the gated layers'
    fused input projection hands it over."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return self.conv(x.chunk(3, dim=-1)[1])


def module_cases(device, dtype=torch.float32):
    """(name, module, inputs, kwargs) for every fused module and mode the models use."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    norm = RMSNorm(64, eps=1e-6).to(device, dtype)
    gated = RMSNormGated(32, eps=1e-5).to(device, dtype)
    sig = RMSNormGated(32, eps=1e-5, activation="sigmoid").to(device, dtype)
    for m in (norm, gated, sig):
        with torch.no_grad():
            m.weight.copy_(torch.empty(m.weight.shape).uniform_(0.5, 1.5, generator=g))
    conv = ShortConvolution(48, 4, activation="silu").to(device, dtype)
    conv_plain = ShortConvolution(48, 4, activation=None).to(device, dtype)
    mlp = GatedMLP(64, intermediate_size=128).to(device, dtype)
    cu = torch.tensor([0, 3, 4, 21], device=device)
    return [
        ("rms_norm", norm, [randn(2, 19, 64)], {}),
        ("rms_norm prenorm residual", _PreNorm(norm), [randn(2, 19, 64), randn(2, 19, 64)], {}),
        ("rms_norm_gated swish", gated, [randn(2, 19, 4, 32), randn(2, 19, 4, 32)], {}),
        ("rms_norm_gated sigmoid", sig, [randn(2, 19, 4, 32), randn(2, 19, 4, 32)], {}),
        ("short conv", conv, [randn(2, 19, 48)], {}),
        ("short conv, no activation", conv_plain, [randn(2, 19, 48)], {}),
        ("short conv, cache", conv, [randn(2, 19, 48)], {"cache": randn(2, 48, 4)}),
        ("short conv, strided input", _SliceConv(conv), [randn(2, 19, 3 * 48)], {}),
        ("short conv, varlen + cache", conv, [randn(1, 21, 48)], {"cu_seqlens": cu, "cache": randn(3, 48, 4)}),
        ("swiglu + down proj", mlp, [randn(2, 19, 64)], {}),
        # a spans softplus' linear (> 20 after the bias) and exponential tails
        ("decay gate", _DecayGate(6).to(device, dtype), [8 * randn(2, 19, 6)], {}),
    ]


def check_modules(device, dtype=torch.float32, allow_cpu=False) -> dict[str, float]:
    """Worst relative error per case (fused vs PyTorch, same dtype)."""
    return {name: max(compare(m, x, kw, allow_cpu=allow_cpu)) for name, m, x, kw in module_cases(device, dtype)}


def check_chunk_ops(device, dtype=torch.float32) -> dict[str, float]:
    """The chunk kernels with the q (and k) L2 normalisation done in the op, against the float64
    per-token reference with the normalisation written out."""
    import efla.ops as ops
    from efla.ops.cuda import custom_ops as C

    g = torch.Generator().manual_seed(1)
    # the interpreter is slow: small heads there; the GPU kernels at a head size the models use
    B, T, H, K, V = (1, 70, 2, 16, 16) if device.type == "cpu" else (2, 130, 2, 64, 64)
    q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, V, generator=g)
    k = torch.randn(B, T, H, K, generator=g) * 10 ** (torch.rand(B, T, H, 1, generator=g) * 2 - 1)
    beta, lg = torch.rand(B, T, H, generator=g), -torch.rand(B, T, H, generator=g)
    dout = torch.randn(B, T, H, V, generator=g)
    worst = {}
    for kind, k_l2 in (("efla", False), ("efla", True), ("gated_efla", False), ("gated_delta_rule", True)):
        gated = kind.startswith("gated")
        leaves = [x.to(device, dtype).clone().requires_grad_() for x in (q, k, v, beta)] + [
            lg.to(device).clone().requires_grad_()
        ]
        o, _ = C.chunk_forward(
            kind, leaves[0], leaves[1], leaves[2], leaves[4] if gated else None, leaves[3], K**-0.5, None, False, None, True, k_l2
        )
        (o.float() * dout.to(device)).sum().backward()
        got = [o] + [x.grad for x in leaves[:4]] + ([leaves[4].grad] if gated else [])
        ref_leaves = [x.double().clone().requires_grad_() for x in (q, k, v, beta, lg)]
        qn = ops.l2_normalize(ref_leaves[0])
        kn = ops.l2_normalize(ref_leaves[1]) if k_l2 else ref_leaves[1]
        args = [qn, kn, ref_leaves[2]] + ([ref_leaves[4]] if gated else []) + [ref_leaves[3]]
        ro, _ = getattr(ops, f"recurrent_{kind}")(*args)
        (ro * dout.double()).sum().backward()
        ref = [ro] + [x.grad for x in ref_leaves[:4]] + ([ref_leaves[4].grad] if gated else [])
        worst[f"{kind}{' (q, k normalised)' if k_l2 else ' (q normalised)'}"] = max(rel(a, b) for a, b in zip(got, ref))
    return worst


class _LoopInt(int):
    """A loop counter of an interpreted kernel: an int that also answers ``.to(dtype)``."""

    def to(self, *args, **kwargs):
        return self


def _loop_range(*args):
    return (_LoopInt(i) for i in builtins.range(*args))


def prepare_interpreter() -> None:
    """Let fla's kernels run under TRITON_INTERPRET=1: no autotuning benchmarks (there is no GPU to
    time on) and loop counters that support ``.to``, as compiled Triton's do."""
    import importlib

    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner._bench = lambda self, *args, **kwargs: [1.0, 1.0, 1.0]
    for name in (
        "fla.ops.common.chunk_delta_h",
        "fla.ops.common.chunk_o",
        "fla.ops.delta_rule.wy_fast",
        "fla.ops.gated_delta_rule.wy_fast",
        "fla.ops.utils.solve_tril",
        "fla.ops.common.chunk_scaled_dot_kkt",
        "fla.ops.utils.cumsum",
    ):
        importlib.import_module(name).range = _loop_range


def main() -> int:
    """Interpreter run: print every case's worst relative error, one per line."""
    prepare_interpreter()
    cpu = torch.device("cpu")
    results = {**check_modules(cpu, allow_cpu=True), **check_chunk_ops(cpu)}
    for name, err in results.items():
        print(f"{name}\t{err:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
