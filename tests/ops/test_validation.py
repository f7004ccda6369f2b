"""Bad input raises ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

import efla.ops as ops


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
