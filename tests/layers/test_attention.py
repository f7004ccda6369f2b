"""Attention (hybrid models' softmax layer) against a naive per-query softmax reference."""

import math

import pytest
import torch

from efla.layers import Attention
from efla.models import EFLACache

D = 32


def make(**kw):
    torch.manual_seed(3)
    layer = Attention(hidden_size=D, layer_idx=0, **kw).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)  # larger than the init so the softmax is far from uniform
    return layer


def rotate_pairs(x, positions, theta):
    """Channel i and i + D/2 of every head form a 2-D vector turned by ``position * theta**(-2i/D)``."""
    out = x.clone()
    half = x.shape[-1] // 2
    for i in range(half):
        angle = positions[..., None].double() * theta ** (-2 * i / x.shape[-1])
        c, s = torch.cos(angle), torch.sin(angle)
        a, b = x[..., i], x[..., i + half]
        out[..., i], out[..., i + half] = a * c - b * s, a * s + b * c
    return out


def reference(layer, x, window=None, real=None):
    """Per row, per head, per query: softmax over the real keys at or before it (within the window),
    positions counting real tokens only; zero output at padding."""
    B, T, _ = x.shape
    H, Hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    real = torch.ones(B, T, dtype=torch.bool) if real is None else real.bool()
    q = layer.q_proj(x).view(B, T, H, d)
    k = layer.k_proj(x).view(B, T, Hkv, d)
    v = layer.v_proj(x).view(B, T, Hkv, d)
    pos = real.long().cumsum(1) - 1
    q, k = rotate_pairs(q, pos, layer.rope_theta), rotate_pairs(k, pos, layer.rope_theta)
    o = torch.zeros(B, T, H, d, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for t in range(T):
                if not real[b, t]:
                    continue
                keys = [j for j in range(t + 1) if real[b, j] and (window is None or pos[b, t] - pos[b, j] < window)]
                scores = torch.stack([q[b, t, h] @ k[b, j, kv] for j in keys]) / math.sqrt(d)
                o[b, t, h] = (scores.softmax(0)[:, None] * v[b, keys, kv]).sum(0)
    return layer.o_proj(o.reshape(B, T, H * d))


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (4, 2, None), (4, 1, 3), (2, 2, 5)])
def test_attention_matches_naive_softmax(heads, kv_heads, window):
    layer = make(num_heads=heads, num_kv_heads=kv_heads, window_size=window, qkv_bias=True, rope_theta=100.0)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], reference(layer, x, window), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
def test_padding_is_skipped_not_attended(window):
    layer = make(num_heads=4, num_kv_heads=2, window_size=window)
    x = torch.randn(2, 8, D, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 1, 1]])  # left and inner padding
    with torch.no_grad():
        got = layer(x, attention_mask=mask)[0]
        torch.testing.assert_close(got, reference(layer, x, window, real=mask), rtol=1e-10, atol=1e-12)
        # a left-padded row is the unpadded sequence
        torch.testing.assert_close(got[0, 2:], layer(x[:1, 2:])[0][0], rtol=1e-10, atol=1e-12)
    assert got[0, :2].abs().max() == 0 and got[1, [2, 5]].abs().max() == 0


@pytest.mark.parametrize("window", [None, 2])
def test_packed_sequences_do_not_see_each_other(window):
    layer = make(num_heads=4, num_kv_heads=2, window_size=window)
    lens = [5, 1, 4]
    seqs = [torch.randn(1, n, D, dtype=torch.float64) for n in lens]
    cu = torch.tensor([0, 5, 6, 10])
    with torch.no_grad():
        packed = layer(torch.cat(seqs, 1), cu_seqlens=cu)[0]
        alone = torch.cat([layer(s)[0] for s in seqs], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
def test_cached_decoding_equals_full_and_window_trims_the_cache(window):
    layer = make(num_heads=4, num_kv_heads=2, window_size=window)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    cache = EFLACache(1)
    with torch.no_grad():
        parts = [layer(x[:, :5], past_key_values=cache, use_cache=True)[0]]
        parts.append(layer(x[:, 5:7], past_key_values=cache, use_cache=True)[0])
        for t in range(7, 12):
            parts.append(layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)[0])
        full = layer(x)[0]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-12)
    keys, values = cache[0]["attn_state"]
    assert keys.shape == values.shape == (2, 12 if window is None else window - 1, 2, D // 4)
    assert cache[0]["next_position"].tolist() == [12, 12] and cache.get_seq_length() == 12


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_heads=3), "num_heads"),
        (dict(num_heads=32), "num_heads"),  # head dim 1 is odd
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(num_heads=4, window_size=0), "window_size"),
    ],
)
def test_invalid_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        Attention(hidden_size=D, **kw)


def test_refuses_packed_input_on_top_of_a_cache():
    layer = make(num_heads=2)
    cache = EFLACache(1)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    layer(x, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, past_key_values=cache, use_cache=True, cu_seqlens=torch.tensor([0, 2, 4]))
