"""A small autotuned Triton kernel with a heuristic, for the tests of ``efla.ops.cuda.launch``
(imported only where Triton is installed)."""

import triton
import triton.language as tl

from efla import environment

# Triton's CPU interpreter cannot time settings: one setting there
SETTINGS = [(32, 1)] if environment.get("TRITON_INTERPRET") else [(b, w) for b in (32, 128) for w in (1, 4)]


@triton.heuristics({"HAS_SHIFT": lambda args: args["shift"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in SETTINGS], key=["n"])
@triton.jit
def scale_shift_kernel(x, shift, y, n, scale, BLOCK: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """``y = x * scale (+ shift)`` over ``n`` elements."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    out = tl.load(x + offsets, mask=mask) * scale
    if HAS_SHIFT:
        out += tl.load(shift + offsets, mask=mask)
    tl.store(y + offsets, out, mask=mask)


@triton.jit
def copy_kernel(x, y, n, BLOCK: tl.constexpr):
    """``y = x`` over ``n`` elements (a plain kernel, launched with options such as ``num_warps``)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y + offsets, tl.load(x + offsets, mask=mask), mask=mask)
