"""Bad input raises ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

import efla.ops as ops
from efla.errors import NonFiniteValues


def good(B=2, T=10, H=3, K=4, V=5):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, H, K, generator=gen),
        k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, H, V, generator=gen),
        g=-torch.rand(B, T, H, generator=gen),
        beta=torch.rand(B, T, H, generator=gen),
    )


def run(x, gated=True, mode="chunk", **kw):
    if gated:
        return getattr(ops, f"{mode}_gated_efla")(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return getattr(ops, f"{mode}_efla")(x["q"], x["k"], x["v"], x["beta"], **kw)


CASES = [
    ("q", lambda x: x.update(q=x["q"][0]), "q"),
    ("k shape", lambda x: x.update(k=x["k"][:, :5]), "k"),
    ("v batch", lambda x: x.update(v=x["v"][:1]), "v"),
    ("beta shape", lambda x: x.update(beta=x["beta"][..., :2]), "beta"),
    ("beta rank", lambda x: x.update(beta=x["beta"][..., None]), "beta"),
    ("g shape", lambda x: x.update(g=x["g"][:, :3]), "g"),
    ("g positive", lambda x: x["g"].__setitem__((0, 0, 0), 0.5), "g"),
    ("beta negative", lambda x: x["beta"].__setitem__((0, 0, 0), -0.1), "beta"),
    ("nan q", lambda x: x["q"].__setitem__((0, 1, 0, 0), float("nan")), "q"),
    ("inf k", lambda x: x["k"].__setitem__((1, 1, 0, 0), float("inf")), "k"),
    ("nan v", lambda x: x["v"].__setitem__((1, 2, 0, 0), float("nan")), "v"),
    ("nan beta", lambda x: x["beta"].__setitem__((1, 2, 0), float("nan")), "beta"),
    ("inf g", lambda x: x["g"].__setitem__((1, 2, 0), float("-inf")), "g"),
    ("dtype", lambda x: x.update(v=x["v"].double()), "v"),
    ("int k", lambda x: x.update(k=x["k"].long()), "k"),
]


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("case,mutate,name", CASES, ids=[c[0] for c in CASES])
def test_bad_tensor_inputs(case, mutate, name, mode):
    x = good()
    mutate(x)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        run(x, mode=mode)


def test_bad_initial_state():
    x = good()
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \(2, 3, 4, 5\)"):
        run(x, initial_state=torch.randn(2, 3, 5, 4))
    bad = torch.randn(2, 3, 4, 5)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^initial_state:"):
        run(x, initial_state=bad)


def test_bad_cu_seqlens():
    x = good()
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*B == 1"):
        run(x, cu_seqlens=torch.tensor([0, 10]))
    x = good(B=1)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected to start at 0 and end at T = 10"):
        run(x, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing"):
        run(x, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected an integer dtype"):
        run(x, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \(2, 3, 4, 5\)"):
        run(x, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=torch.randn(1, 3, 4, 5))


def test_gated_needs_g_and_scale_is_checked():
    x = good()
    with pytest.raises(ValueError, match=r"^g:"):
        ops.chunk_gated_efla(x["q"], x["k"], x["v"], None, x["beta"])
    with pytest.raises(ValueError, match=r"^scale:"):
        run(x, scale=float("nan"))
    with pytest.raises(ValueError, match=r"^beta:"):
        ops.efla_coefficient(x["beta"][:, :3], x["k"])


OPS = [(mode, rule) for mode in ("chunk", "recurrent") for rule in ("efla", "gated_efla", "delta_rule", "gated_delta_rule")]


def call_op(mode, rule, x, **kw):
    fn = getattr(ops, f"{mode}_{rule}")
    if rule.startswith("gated"):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return fn(x["q"], x["k"], x["v"], x["beta"], **kw)


@pytest.mark.parametrize("mode,rule", OPS)
@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "g"])
@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_non_tensor_inputs_raise_value_error(mode, rule, name, kind):
    if name == "g" and not rule.startswith("gated"):
        return
    x = good()
    x[name] = x[name].numpy() if kind == "numpy" else x[name].tolist()
    with pytest.raises(ValueError, match=rf"^{name}: expected a torch.Tensor"):
        call_op(mode, rule, x)


@pytest.mark.parametrize("mode,rule", OPS)
def test_non_tensor_state_and_offsets_raise_value_error(mode, rule):
    x = good()
    with pytest.raises(ValueError, match=r"^initial_state: expected a torch.Tensor"):
        call_op(mode, rule, x, initial_state=torch.zeros(2, 3, 4, 5).numpy())
    x = good(B=1)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected an integer torch.Tensor"):
        call_op(mode, rule, x, cu_seqlens=[0, 4, 10])


def test_efla_coefficient_rejects_non_tensors_and_bad_values():
    x = good()
    with pytest.raises(ValueError, match=r"^beta: expected a torch.Tensor"):
        ops.efla_coefficient(x["beta"].numpy(), x["k"])
    with pytest.raises(ValueError, match=r"^k: expected a torch.Tensor"):
        ops.efla_coefficient(x["beta"], x["k"].numpy())
    with pytest.raises(ValueError, match=r"^k: expected a floating-point tensor"):
        ops.efla_coefficient(x["beta"], x["k"].long())
    bad = x["beta"].clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteValues, match=r"^beta: contains 1 non-finite"):  # a ValueError, caught by type
        ops.efla_coefficient(bad, x["k"])
    with pytest.raises(ValueError, match=r"^beta: the step size must be >= 0"):
        ops.efla_coefficient(-x["beta"] - 1.0, x["k"])
    k = x["k"].clone()
    k[0, 0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteValues, match=r"^k: contains 1 non-finite"):
        ops.efla_coefficient(x["beta"], k)
    assert issubclass(NonFiniteValues, ValueError)


def test_efla_coefficient_is_finite_for_any_finite_float32_key():
    # ||k||^2 is formed in float64: float32 keys near the float32 maximum still give alpha = 1/lambda
    k = torch.full((3, 4), 3e38)
    k[1] = 1e19
    k[2] = 0.0
    beta = torch.tensor([0.5, 2.0, 0.7])
    alpha = ops.efla_coefficient(beta, k)
    assert torch.isfinite(alpha).all()
    assert alpha[1].item() == pytest.approx(1 / 4e38, rel=1e-5, abs=0)  # subnormal in float32
    assert alpha[0].item() == 0.0  # 1 / 3.6e77 underflows float32
    assert alpha[2].item() == pytest.approx(0.7, rel=1e-6)


@pytest.mark.parametrize("mode,rule", OPS)
@pytest.mark.parametrize("dtype,factor", [(torch.float32, 1e19), (torch.bfloat16, 1e19), (torch.float64, 1e155)])
def test_keys_whose_squared_norm_overflows_raise_value_error(mode, rule, dtype, factor):
    # chunk mode forms k k^T and returned all-NaN; the scan's alpha = 0 silently skipped the step
    x = {n: t.to(dtype) for n, t in good(T=6).items()}
    x["k"] = x["k"] * factor
    with pytest.raises(ValueError, match=r"^k: a key's squared norm \|\|k\|\|\^2 = .* overflows the compute dtype"):
        call_op(mode, rule, x)


@pytest.mark.parametrize("rule", ["efla", "gated_efla"])
def test_keys_just_below_the_overflow_are_exact_in_both_modes(rule):
    # ||k||^2 ~ 1e37 still fits float32: the step is the projection I - k k^T / ||k||^2, and chunk,
    # scan and a float64 run agree
    x = good(T=12)
    k = x["k"] / x["k"].norm(dim=-1, keepdim=True) * 3e18
    x["k"] = k
    o_chunk, S_chunk = call_op("chunk", rule, x, output_final_state=True)
    o_scan, S_scan = call_op("recurrent", rule, x, output_final_state=True)
    o64, S64 = call_op("recurrent", rule, {n: t.double() for n, t in x.items()}, output_final_state=True)
    for o, S in ((o_chunk, S_chunk), (o_scan, S_scan)):
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        assert ((o.double() - o64).abs().max() / o64.abs().max()).item() < 1e-4
        assert ((S.double() - S64).abs().max() / S64.abs().max()).item() < 1e-4


@pytest.mark.parametrize("mode,rule", OPS)
def test_finite_inputs_whose_result_overflows_raise_value_error(mode, rule):
    x = good()
    x["v"] = torch.full_like(x["v"], 3e38)  # finite, but the true output (~1e40) is not
    with pytest.raises(ValueError, match=r"^q/k/v/beta: the inputs are finite but the result \(o\) overflows"):
        call_op(mode, rule, x, scale=100.0)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_diverging_euler_step_raises_value_error(mode):
    # beta ||k||^2 = 100: the Euler transition's eigenvalue along k is -99, so the state grows
    # ~99x per step and overflows float32 within 20 steps
    x = good(T=40)
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True) * 10.0
    x["beta"] = torch.ones_like(x["beta"])
    with pytest.raises(ValueError, match=r"^q/k/v/beta: the inputs are finite but the result"):
        call_op(mode, "delta_rule", x)


@pytest.mark.parametrize("gated", [False, True])
def test_compiled_op_traces_in_one_graph_and_skips_only_the_value_checks(gated):
    # value checks read values back to Python (a graph break per op call), so compiled code skips
    # them; structural checks still run while tracing, and eager calls keep every check
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="eager", fullgraph=True, dynamic=False)
    x = good()
    o, _ = compiled(x, gated=gated)
    assert torch.equal(o, run(x, gated=gated)[0])
    x["q"][0, 1, 0, 0] = float("nan")
    assert torch.isnan(compiled(x, gated=gated)[0]).any()
    with pytest.raises(ValueError, match="^q: contains"):
        run(x, gated=gated)
    with pytest.raises(ValueError, match="^k: expected shape"):  # Dynamo hands the raise to eager
        torch.compile(run, backend="eager", dynamic=False)(dict(x, k=x["k"][:, :5]), gated=gated)


def test_all_finite_sees_every_bad_value_and_no_false_alarm_from_an_overflowing_sum():
    from efla.ops.validate import all_finite

    x = torch.randn(4, 33, 7)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2, 17, 3] = bad
        assert not all_finite(y)
    both = x.clone()
    both[0, 0, 0], both[1, 1, 1] = float("inf"), -float("inf")  # their sum is NaN: still caught
    assert not all_finite(both)
    huge = torch.full((8,), 3e38)  # finite values whose float32 sum overflows
    assert torch.isinf(huge.sum()) and all_finite(huge)
    assert all_finite(torch.full((4,), 60000.0, dtype=torch.float16))


def test_a_packed_forward_reads_its_offsets_to_the_host_once(monkeypatch):
    """Every layer checks cu_seqlens; on a GPU each host read waits for the device, so the offsets
    are read once per tensor (and again after an in-place change)."""
    from efla.models import EFLAForCausalLM, get_preset_config
    from efla.ops import validate

    reads = []
    real = validate._read_offsets
    monkeypatch.setattr(validate, "_read_offsets", lambda cu: reads.append(1) or real(cu))
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
    assert model.config.num_hidden_layers >= 2
    cu_seqlens = torch.tensor([0, 5, 12])
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 12)), cu_seqlens=cu_seqlens)
    assert len(reads) == 1
    cu_seqlens[1] = 6  # changed in place: read again, and checked again
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 12)), cu_seqlens=cu_seqlens)
    assert len(reads) == 2
    cu_seqlens[1] = 13
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets"):
        validate.check_cu_seqlens(cu_seqlens, 1, 12)
