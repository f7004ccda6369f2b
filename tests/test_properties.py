"""Property: every public op and layer either returns finite results or raises ValueError.

Hypothesis throws tiny random shapes, dtypes, NaN/Inf, negative, tiny and huge values, wrong
types and malformed ``cu_seqlens`` at ``efla.ops`` and ``efla.layers``. Any other exception, or a
non-finite result, fails. Runs derandomized and without an example database, so CI sees the same
cases every time; shapes are tiny so thousands of cases fit in well under a minute on 2 cores.
On a GPU the ops are also run (fixed head dims) with value checks on, which is opt-in there.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import efla.ops as ops
from efla import environment
from efla.layers import EFLA, GatedEFLA

PROFILE = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

RULES = ("efla", "gated_efla", "delta_rule", "gated_delta_rule")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# magnitudes from zero through subnormal to the edge of float32 (and beyond, for float64)
SCALES = (0.0, 1e-40, 1e-20, 1e-3, 1.0, 3.0, 1e3, 1e10, 1e19, 1e30, 3e38, 1e200)
TAME_SCALES = (0.0, 1e-20, 1e-3, 1.0, 3.0, 1e3)
SPECIALS = (float("nan"), float("inf"), float("-inf"))


@st.composite
def tensors(draw, shape, dtype, device, sign=0, hostile=True, scales=SCALES):
    """A tensor of ``shape``: a seeded normal sample times a drawn magnitude (cast to ``dtype``;
    magnitudes beyond its range become Inf). ``sign`` > 0 makes it non-negative and < 0
    non-positive. ``hostile``: any of ``scales``, sometimes the wrong sign, sometimes a planted
    NaN/Inf."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * draw(st.sampled_from(scales if hostile else TAME_SCALES))
    if sign and (not hostile or draw(st.integers(0, 9)) > 0):
        x = x.abs() * sign
    if hostile and x.numel() and draw(st.integers(0, 19)) == 0:
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    return x.to(device=device, dtype=dtype)


def _malformed(draw, value, hostile=True):
    """Mostly ``value``; when ``hostile``, sometimes a numpy array, a list or None in its place."""
    kind = draw(st.integers(0, 49)) if hostile else -1
    if kind == 0 and isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy()
    if kind == 1 and isinstance(value, torch.Tensor):
        return value.tolist()
    if kind == 2:
        return None
    return value


@st.composite
def offsets(draw, T, hostile=True):
    """``cu_seqlens``: None, valid, or (when ``hostile``) malformed: wrong ends, decreasing,
    float, 2-D, a list, too short."""
    malformed = ("random", "float", "2d", "list", "empty") if hostile else ()
    kind = draw(st.sampled_from(("none", "valid") + malformed))
    if kind == "none":
        return None
    if kind in ("valid", "list", "float", "2d"):
        cuts = sorted(draw(st.lists(st.integers(0, T), max_size=3)))
        cu = [0, *cuts, T]
    else:
        cu = draw(st.lists(st.integers(-2, T + 2), min_size=0 if kind == "empty" else 1, max_size=5))
    if kind == "list":
        return cu
    dtype = torch.float32 if kind == "float" else draw(st.sampled_from((torch.int32, torch.int64)))
    t = torch.tensor(cu, dtype=dtype)
    return t[None] if kind == "2d" else t


@st.composite
def op_calls(draw, device="cpu", head_dims=None):
    """``(rule, mode, inputs, keywords)``; ``head_dims=(K, V)`` fixes the head dims (on a GPU each
    new pair compiles kernels)."""
    # half the calls are tame (well-formed, moderate values), so that the "returns finite results"
    # side of the property is exercised as often as the ValueError side
    hostile = draw(st.booleans())
    rule, mode = draw(st.sampled_from(RULES)), draw(st.sampled_from(("chunk", "recurrent")))
    dtype = draw(st.sampled_from(DTYPES))
    B, T, H = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 2))
    K, V = head_dims or (draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    if hostile and head_dims is None and draw(st.integers(0, 9)) == 0:  # occasionally a zero-sized dim
        K = draw(st.integers(0, 5))
    x = {
        "q": draw(tensors((B, T, H, K), dtype, device, hostile=hostile)),
        "k": draw(tensors((B, T, H, K), dtype, device, hostile=hostile)),
        "v": draw(tensors((B, T, H, V), dtype, device, hostile=hostile)),
        "beta": draw(tensors((B, T, H), dtype, device, sign=1, hostile=hostile)),
        "g": draw(tensors((B, T, H), dtype, device, sign=-1, hostile=hostile)),
    }
    for name in x:
        x[name] = _malformed(draw, x[name], hostile)
    cu = draw(offsets(T, hostile))
    N = len(cu) - 1 if isinstance(cu, torch.Tensor) and cu.dim() == 1 and len(cu) > 1 else B
    kw = {
        "scale": draw(st.sampled_from((None, 0.5, 0.0, -2.0) + ((1e30, float("nan"), float("inf"), "1") if hostile else ()))),
        "initial_state": draw(st.none() | tensors((N, H, K, V), draw(st.sampled_from(DTYPES)), device, hostile=hostile)),
        "output_final_state": draw(st.booleans()),
        "cu_seqlens": cu if B == 1 or draw(st.integers(0, 4)) == 0 else None,
    }
    return rule, mode, x, kw


def _call_op(rule, mode, x, kw):
    fn = getattr(ops, f"{mode}_{rule}")
    if rule.startswith("gated"):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return fn(x["q"], x["k"], x["v"], x["beta"], **kw)


def _finite_or_value_error(call):
    """Run ``call`` with value checks on (on a GPU they are opt-in: each costs a sync); return its
    result when it succeeded, ``None`` when it raised ValueError."""
    try:
        with environment.override(EFLA_CHECK_VALUES=True):
            out = call()
    except ValueError as e:
        assert str(e), "ValueError without a message"
        event("ValueError: " + str(e).split(":")[0])  # per argument, in --hypothesis-show-statistics
        return None
    event("returned")
    return out


def _check_op_call(case):
    rule, mode, x, kw = case
    out = _finite_or_value_error(lambda: _call_op(rule, mode, x, kw))
    if out is None:
        return
    o, S = out
    assert o.shape == x["v"].shape and o.dtype == x["q"].dtype
    assert torch.isfinite(o).all(), f"{mode}_{rule}: non-finite output"
    assert (S is None) == (not kw["output_final_state"])
    if S is not None:
        assert torch.isfinite(S).all(), f"{mode}_{rule}: non-finite final state"


@settings(max_examples=2500, **PROFILE)
@given(op_calls())
def test_ops_return_finite_results_or_raise_value_error(case):
    _check_op_call(case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=300, **PROFILE)
@given(op_calls(device="cuda", head_dims=(16, 16)))
def test_ops_on_gpu_return_finite_results_or_raise_value_error(case):
    _check_op_call(case)


@st.composite
def coefficient_calls(draw, device="cpu"):
    dtype = draw(st.sampled_from(DTYPES))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    K = draw(st.integers(1, 4))
    beta = draw(tensors(lead, dtype, device, sign=1))
    k = draw(tensors((*lead, K), draw(st.sampled_from(DTYPES)), device))
    if draw(st.integers(0, 9)) == 0:
        beta = beta[..., :1] if beta.dim() else beta[None]  # mismatched shape
    return _malformed(draw, beta), _malformed(draw, k)


@settings(max_examples=600, **PROFILE)
@given(coefficient_calls())
def test_efla_coefficient_returns_finite_results_or_raises_value_error(case):
    beta, k = case
    alpha = _finite_or_value_error(lambda: ops.efla_coefficient(beta, k))
    if alpha is not None:
        assert alpha.shape == beta.shape and torch.isfinite(alpha).all()
        assert (alpha >= 0).all() and (alpha <= beta).all()  # alpha = beta phi(beta lambda), 0 < phi <= 1


HIDDEN = 8


@functools.cache
def _layer(kind: str, update_rule: str, mode: str, dtype: torch.dtype):
    torch.manual_seed(0)
    if kind == "EFLA":
        layer = EFLA(hidden_size=HIDDEN, num_heads=2, mode=mode, update_rule=update_rule, use_gate=True)
    else:
        layer = GatedEFLA(hidden_size=HIDDEN, head_dim=4, num_heads=2, expand_v=1, mode=mode, update_rule=update_rule)
    return layer.to(dtype).eval()


@st.composite
def layer_calls(draw):
    dtype = draw(st.sampled_from(DTYPES))
    layer = _layer(
        draw(st.sampled_from(("EFLA", "GatedEFLA"))),
        draw(st.sampled_from(("exact", "euler"))),
        draw(st.sampled_from(("chunk", "recurrent"))),
        dtype,
    )
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    D = HIDDEN if draw(st.integers(0, 9)) else draw(st.integers(0, 9))
    hidden = _malformed(draw, draw(tensors((B, T, D), dtype, "cpu", scales=SCALES)))
    mask = None
    if draw(st.booleans()):
        mask = torch.tensor(
            draw(st.lists(st.integers(0, 2 if draw(st.integers(0, 9)) == 0 else 1), min_size=B * T, max_size=B * T))
        ).view(B, T)
    return layer, hidden, mask, draw(offsets(T)) if B == 1 and draw(st.booleans()) else None


@settings(max_examples=500, **PROFILE)
@given(layer_calls())
def test_layers_return_finite_results_or_raise_value_error(case):
    layer, hidden, mask, cu = case
    with torch.no_grad():
        out = _finite_or_value_error(lambda: layer(hidden, attention_mask=mask, cu_seqlens=cu))
    if out is not None:
        assert out[0].shape == hidden.shape
        assert torch.isfinite(out[0]).all(), f"{type(layer).__name__}: non-finite output"


def test_float64_layer_with_hidden_states_beyond_float32_range():
    hidden = torch.full((1, 2, HIDDEN), 1e200, dtype=torch.float64)
    layer = _layer("EFLA", "exact", "chunk", torch.float64)
    with torch.no_grad():
        try:
            out = layer(hidden)[0]
        except ValueError as e:  # the keys' squared norms overflow float64: named, not NaN
            assert str(e).startswith("k:"), e
            return
    assert torch.isfinite(out).all()


def test_hidden_states_checks_name_the_argument():
    from efla.layers._common import check_hidden_states

    x = torch.zeros(2, 3, HIDDEN, dtype=torch.float64)
    assert check_hidden_states(x, HIDDEN, expected_dtype=torch.float64) == (2, 3)
    with pytest.raises(ValueError, match=r"^hidden_states: expected dtype torch.float32 \(the layer's parameters\)"):
        check_hidden_states(x, HIDDEN, expected_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^hidden_states: expected a floating-point tensor"):
        check_hidden_states(x.long(), HIDDEN)
    x[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^hidden_states: contains 1 non-finite"):
        check_hidden_states(x, HIDDEN)
