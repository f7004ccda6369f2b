"""Input checks shared by every public op.

Every failure raises :class:`ValueError` naming the argument, what was expected and what was
received. Checks never modify their inputs. Structure (types, shapes, dtypes, devices) is
always checked; values (NaN/Inf, signs, key norms, an overflowing result) on the CPU always
and on a GPU only with ``EFLA_CHECK_VALUES=1`` (there each scan costs a device sync); neither
inside code that ``torch.compile`` traces (see ``values_checked``). On a GPU, keys whose
``||k||^2`` overflows float32 are refused whatever ``EFLA_CHECK_VALUES`` says: by the exact rules'
chunk kernels (``key_energy_error``) and, before the Euler rules' kernels, an in-kernel key
normalisation or the PyTorch path, by ``check_key_energy`` (both off with ``EFLA_CHECK_KEYS=0``;
when the chunk kernels' flags are read: ``efla.ops.cuda.key_checks``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.utils.weak

from efla import environment
from efla.errors import NonFiniteValues


@dataclass(frozen=True)
class Dims:
    B: int  # batch (1 in varlen mode)
    T: int  # tokens per row
    H: int  # query / key heads
    K: int  # key / query head dim
    V: int  # value head dim
    N: int  # number of sequences (B, or len(cu_seqlens) - 1)
    HV: int  # value heads (states, beta, g): a multiple of H; value head i reads q/k head i // (HV // H)

    @property
    def groups(self) -> int:
        """Value heads per query/key head."""
        return self.HV // self.H


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def _check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {_shape(x)} ({x.dim()}-D)")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


_unchecked = threading.local()


@contextlib.contextmanager
def unchecked_values():
    """Skip the value checks in this thread inside the block, on every device: for a caller whose
    inputs are a model's own activations, each step of a decoding loop (a step's checks cost more
    than the step on the CPU), as a GPU skips them by default."""
    before = getattr(_unchecked, "on", False)
    _unchecked.on = True
    try:
        yield
    finally:
        _unchecked.on = before


def values_checked(x: torch.Tensor) -> bool:
    """Whether value checks run for inputs on ``x``'s device (always on the CPU; opt-in on a GPU).

    Never while ``torch.compile`` traces: each check reads a value back to Python, which would
    split the compiled graph at every op call; eager calls keep every check (but inside
    ``unchecked_values()``)."""
    if torch.compiler.is_compiling() or getattr(_unchecked, "on", False):
        return False
    if not x.is_cuda:
        return True
    return environment.get("EFLA_CHECK_VALUES")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops compute in: float64 for float64 inputs, float32 for every other."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite. A sum carries any NaN or Inf through, so one reduction
    (a twentieth of ``isfinite(x).all()``'s time on a CPU) settles the common case; only a sum that
    is not finite (a bad value, or finite values whose sum overflows) takes the exact test."""
    return bool(torch.isfinite(x.detach().sum())) or bool(torch.isfinite(x).all())


def _check_finite(name: str, x: torch.Tensor) -> None:
    if not all_finite(x):
        bad = (~torch.isfinite(x)).sum().item()
        raise NonFiniteValues(f"{name}: contains {bad} non-finite value(s) (NaN or Inf)")


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
    gated: bool,
    check_values: bool | None = None,
) -> Dims:
    """Check shapes, dtypes, devices and values of an op's inputs; return the sizes.

    ``check_values=None`` decides by device (see ``values_checked``).
    """
    B, T, H, HV, K, V = _check_qkv(q, k, v)
    _check_per_token("beta", beta, (B, T, HV))
    if gated:
        if g is None:
            raise ValueError("g: the gated ops need a log-gate tensor g of shape [B, T, HV], got None")
        _check_per_token("g", g, (B, T, HV))
    for name, x in (("k", k), ("v", v), ("beta", beta)) + ((("g", g),) if gated else ()):
        gate_in_float32 = name == "g" and x.dtype == torch.float32  # fla's layers keep gates in float32
        if x.dtype != q.dtype and not gate_in_float32:
            expected = f"{q.dtype} (same as q) or torch.float32" if name == "g" else f"{q.dtype} (same as q)"
            raise ValueError(f"{name}: expected dtype {expected}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (same as q), got {x.device}")
    _check_scale(scale)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        _check_initial_state(initial_state, (N, HV, K, V), q.device)
    if check_values is None:
        check_values = values_checked(q)
    if check_values:
        _check_values(q, k, v, beta, g if gated else None, initial_state)
    return Dims(B=B, T=T, H=H, K=K, V=V, N=N, HV=HV)


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """``(B, T, H, HV, K, V)`` of ``q, k [B, T, H, K]`` and ``v [B, T, HV, V]``."""
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {_shape(q)} (same as q: [B, T, H, K]), got {_shape(k)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v: expected shape ({B}, {T}, HV, V) matching q's [B, T], got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if T < 1:
        raise ValueError(f"q: expected at least one token (T >= 1), got shape {_shape(q)}")
    if K < 1 or V < 1 or H < 1 or B < 1 or HV < 1:
        raise ValueError(f"q/v: empty dimension in q {_shape(q)} or v {_shape(v)}")
    if HV % H != 0:
        raise ValueError(
            f"v: expected a number of value heads HV that is a multiple of the {H} query/key heads "
            f"(grouped values), got v of shape {_shape(v)} with HV = {HV}"
        )
    return B, T, H, HV, K, V


def _check_per_token(name: str, x, shape: tuple[int, int, int]) -> None:
    _check_tensor(name, x, 3)
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} = [B, T, HV] (one per value head), got {_shape(x)}")


def _check_scale(scale) -> None:
    if scale is None:
        return
    if not isinstance(scale, (int, float)) or not (scale == scale) or scale in (float("inf"), float("-inf")):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")


_host_copies = torch.utils.weak.WeakIdKeyDictionary()  # cu_seqlens tensor -> (its version, CPU copy)


def _read_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens.detach().to("cpu", torch.int64)


def host_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` as a CPU int64 tensor, read from its device once per tensor (again only after
    an in-place change): every layer of a packed forward checks the same offsets, and on a GPU each
    read would wait for the device."""
    if torch.compiler.is_compiling():
        return _read_offsets(cu_seqlens)
    held = _host_copies.get(cu_seqlens)
    if held is None or held[0] != cu_seqlens._version:
        held = _host_copies[cu_seqlens] = (cu_seqlens._version, _read_offsets(cu_seqlens))
    return held[1]


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Check varlen offsets into ``T`` packed tokens (``B == 1``); return the number of sequences."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected an integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor of length N+1 >= 2, got shape {_shape(cu_seqlens)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: expected an integer dtype, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen input needs batch size B == 1 (sequences packed along T), got B = {B}")
    cs = host_offsets(cu_seqlens)
    if int(cs[0]) != 0 or int(cs[-1]) != T:
        raise ValueError(f"cu_seqlens: expected to start at 0 and end at T = {T}, got first {int(cs[0])}, last {int(cs[-1])}")
    if bool((cs[1:] < cs[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {cs.tolist()}")
    return cs.numel() - 1


def _check_initial_state(initial_state, shape: tuple[int, int, int, int], device: torch.device) -> None:
    _check_tensor("initial_state", initial_state, 4)
    if initial_state.shape != shape:
        N, HV, K, V = shape
        raise ValueError(f"initial_state: expected shape ({N}, {HV}, {K}, {V}) = [N, HV, K, V], got {_shape(initial_state)}")
    if initial_state.device != device:
        raise ValueError(f"initial_state: expected device {device} (same as q), got {initial_state.device}")


def _check_values(q, k, v, beta, g, initial_state) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        _check_finite(name, x)
    if g is not None:
        _check_finite("g", g)
        if bool((g > 0).any()):
            raise ValueError(f"g: the log gate must be <= 0 (gate exp(g) in (0, 1]), got max {g.max().item():.4g}")
    if bool((beta < 0).any()):
        raise ValueError(f"beta: the step size must be >= 0, got min {beta.min().item():.4g}")
    if initial_state is not None:
        _check_finite("initial_state", initial_state)
    check_key_energy(k)


def check_key_energy(k: torch.Tensor) -> None:
    """Every op forms ``k k^T`` in the compute dtype, so ``||k||^2`` must be representable there."""
    cdt = compute_dtype(k.dtype)
    kc = k.detach().to(cdt)
    if all_finite((kc * kc).sum(-1)):
        return
    raise key_energy_error(k)


def key_energy_error(k: torch.Tensor) -> ValueError:
    """The error for keys whose largest ``||k||^2`` overflows their compute dtype."""
    cdt = compute_dtype(k.dtype)
    k64 = k.detach().to(torch.float64)  # measured where no float32 key overflows, for the message
    largest = (k64 * k64).sum(-1).max().item()
    return ValueError(
        f"k: a key's squared norm ||k||^2 = {largest:.4g} overflows the compute dtype {cdt} "
        f"(max {torch.finfo(cdt).max:.4g}); scale the keys down"
    )


def validate_coefficient_inputs(beta, k, g=None) -> None:
    """Checks of ``efla_coefficient(beta, k)`` and ``gated_efla_coefficients(beta, k, g)``: floating
    tensors, ``beta`` (and ``g``) of ``k``'s shape without the last dim, one device; values (by
    device, see ``values_checked``) finite, ``beta >= 0``, ``g <= 0``."""
    named = (("beta", beta), ("k", k)) + ((("g", g),) if g is not None else ())
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if k.dim() < 1 or beta.shape != k.shape[:-1]:
        raise ValueError(f"beta: expected shape {tuple(k.shape[:-1])} (k's shape without the last dim), got {_shape(beta)}")
    if g is not None and g.shape != beta.shape:
        raise ValueError(f"g: expected shape {tuple(beta.shape)} (beta's shape), got {_shape(g)}")
    for name, x in named[1:]:
        if x.device != beta.device:
            raise ValueError(f"{name}: expected device {beta.device} (same as beta), got {x.device}")
    if values_checked(beta):
        for name, x in named:
            _check_finite(name, x)
        if bool((beta < 0).any()):
            raise ValueError(f"beta: the step size must be >= 0, got min {beta.min().item():.4g}")
        if g is not None and bool((g > 0).any()):
            raise ValueError(f"g: the log gate must be <= 0 (gate exp(g) in (0, 1]), got max {g.max().item():.4g}")


def check_result(o: torch.Tensor, final_state: torch.Tensor | None, q, k, v, beta, initial_state) -> None:
    """Finite inputs can still overflow the result (huge values, or an Euler step with
    ``beta ||k||^2 > 2``, which expands the state every step): report it rather than return Inf/NaN."""
    for name, x in (("o", o), ("final_state", final_state)):
        if x is None or all_finite(x):
            continue
        sizes = ", ".join(
            f"max |{n}| {t.detach().abs().max().item():.3g}"
            for n, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", initial_state))
            if t is not None
        )
        raise ValueError(
            f"q/k/v/beta: the inputs are finite but the result ({name}) overflows {x.dtype} ({sizes}); "
            "rescale the inputs (an Euler step with beta * ||k||^2 > 2 grows the state every step)"
        )
