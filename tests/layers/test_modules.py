"""Building blocks: short causal convolution (dense, cached, packed), norms, SwiGLU MLP."""

import pytest
import torch
import torch.nn.functional as F

from efla.layers.modules import GatedMLP, RMSNorm, RMSNormGated, ShortConvolution, l2_normalize, mlp_intermediate_size

torch.manual_seed(0)


def _naive_conv(x, weight, bias, history=None, act=True):
    """Per-position sum over the last W inputs (zeros / history before the start)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    hist = torch.zeros(B, D, W) if history is None else history
    seq = torch.cat([hist.transpose(1, 2), x], dim=1)  # [B, W + T, D]
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for t in range(T):
        window = seq[:, t + 1 : t + 1 + W].double()  # the W inputs ending at x[t]
        out[:, t] = (window * weight[:, 0, :].T.double()).sum(1)
    if bias is not None:
        out = out + bias.double()
    return (F.silu(out) if act else out).float()


def _conv(D=6, W=4, bias=True, act="silu"):
    conv = ShortConvolution(D, W, bias=bias, activation=act)
    with torch.no_grad():
        conv.weight.normal_()
        if bias:
            conv.bias.normal_()
    return conv


@pytest.mark.parametrize("act", ["silu", None])
def test_conv_matches_naive_and_state(act):
    conv = _conv(act=act)
    x = torch.randn(3, 11, 6)
    y, s = conv(x, output_final_state=True)
    torch.testing.assert_close(
        y, _naive_conv(x, conv.weight.detach(), conv.bias.detach(), act=act is not None), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(s, x[:, -4:].transpose(1, 2))  # last W inputs, oldest first
    # shorter than the kernel: zeros before the start
    y2, s2 = conv(x[:, :2], output_final_state=True)
    assert torch.equal(s2[..., :2], torch.zeros(3, 6, 2)) and torch.equal(s2[..., 2:], x[:, :2].transpose(1, 2))


def test_conv_cache_continuation_and_steps():
    conv = _conv()
    x = torch.randn(2, 13, 6)
    y_full, s_full = conv(x, output_final_state=True)
    y1, s = conv(x[:, :5], output_final_state=True)
    y2, s = conv(x[:, 5:9], cache=s, output_final_state=True)
    ys = [y1, y2]
    for t in range(9, 13):  # token-by-token decoding
        yt, s = conv(x[:, t : t + 1], cache=s, output_final_state=True)
        ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_full)


@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None)])
def test_conv_inference_path_matches_naive_and_runs_no_conv1d(bias, act, monkeypatch):
    # without autograd the CPU convolution is a sum of shifted inputs (no oneDNN kernel per shape)
    conv = _conv(bias=bias, act=act)
    x, history = torch.randn(3, 11, 6), torch.randn(3, 6, 4)
    with torch.enable_grad():  # conv1d's path
        expected = [conv(x, output_final_state=True), conv(x, cache=history, output_final_state=True)]

    def refuse(*args, **kwargs):
        raise AssertionError("conv1d ran")

    monkeypatch.setattr(F, "conv1d", refuse)
    with torch.no_grad():
        y, s = conv(x, output_final_state=True)
        yc, sc = conv(x, cache=history, output_final_state=True)
    b = conv.bias if bias else None
    torch.testing.assert_close(y, _naive_conv(x, conv.weight, b, act=act is not None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(yc, _naive_conv(x, conv.weight, b, history, act=act is not None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, x[:, -4:].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(sc, s, rtol=0, atol=0)
    for (y_ref, s_ref), (y_new, s_new) in zip(expected, [(y, s), (yc, sc)]):
        torch.testing.assert_close(y_new, y_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s_new, s_ref, rtol=0, atol=0)


def test_conv_varlen_equals_separate_sequences():
    conv = _conv()
    lens = [5, 1, 9, 3]
    xs = [torch.randn(1, n, 6) for n in lens]
    hist = torch.randn(len(lens), 6, 4)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    packed = torch.cat(xs, 1)
    for cache in (None, hist):
        y, s = conv(packed, cache=cache, output_final_state=True, cu_seqlens=cu)
        for i, x in enumerate(xs):
            yi, si = conv(x, cache=None if cache is None else cache[i : i + 1], output_final_state=True)
            torch.testing.assert_close(y[:, cu[i] : cu[i + 1]], yi, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s[i : i + 1], si)


def test_conv_bad_inputs():
    conv = _conv()
    with pytest.raises(ValueError, match="x"):
        conv(torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="cache"):
        conv(torch.randn(2, 3, 6), cache=torch.randn(1, 6, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        conv(torch.randn(2, 3, 6), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 4, activation="gelu")


def test_norms_and_l2():
    x, g = torch.randn(4, 7, 16), torch.randn(4, 7, 16)
    n = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        n.weight.normal_()
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight
    torch.testing.assert_close(n(x), ref)
    ng = RMSNormGated(16, eps=1e-6)
    ng.load_state_dict(n.state_dict())
    torch.testing.assert_close(ng(x, g), ref * g * torch.sigmoid(g))
    ns = RMSNormGated(16, eps=1e-6, activation="sigmoid")
    ns.load_state_dict(n.state_dict())
    torch.testing.assert_close(ns(x, g), ref * torch.sigmoid(g))  # fla 0.6 output_gate_activation="sigmoid"
    with pytest.raises(ValueError, match="activation"):
        RMSNormGated(16, activation="relu")
    torch.testing.assert_close(l2_normalize(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    assert torch.equal(l2_normalize(torch.zeros(3, 5)), torch.zeros(3, 5))


def test_mlp_sizes_and_values():
    # flash-linear-attention's rounding: 2/3 * ratio * hidden, up to a multiple of 256
    assert mlp_intermediate_size(1024, 4) == 2816
    assert mlp_intermediate_size(2048, 4) == 5632
    assert mlp_intermediate_size(64, 4) == 256
    assert mlp_intermediate_size(64, 4, 100) == 100
    mlp = GatedMLP(32, hidden_ratio=4)
    x = torch.randn(2, 5, 32)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), ref)
    assert [n for n, _ in mlp.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    with pytest.raises(ValueError, match="hidden_act"):
        GatedMLP(32, hidden_act="gelu")


def _nodes_feeding(param: torch.Tensor, out: torch.Tensor) -> list[str]:
    """Names of the autograd nodes whose output flows straight into ``param``'s gradient."""
    feeding, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is param:
                feeding.append(type(node).__name__)
            stack.append(nxt)
    return feeding


def test_conv_weight_gradient_takes_no_zeroed_copy():
    # the weight [D, 1, W] is handed on as [D, W] by a view: a select's backward ([:, 0]) would
    # write a zeroed copy, two more GPU operations per convolution per training step
    conv = ShortConvolution(8, 4)
    x = torch.randn(1, 9, 8)
    y, _ = conv(x, cu_seqlens=torch.tensor([0, 4, 9]))
    feeding = _nodes_feeding(conv.weight, y)
    assert feeding and "SelectBackward0" not in feeding, feeding
