"""Token mixers EFLA / GatedEFLA: architecture, update rules, cache, masks, packing, stats."""

import pytest
import torch
import torch.nn.functional as F

from efla.layers import EFLA, GatedEFLA
from efla.ops import (
    efla_coefficient,
    recurrent_delta_rule,
    recurrent_efla,
    recurrent_gated_delta_rule,
    recurrent_gated_efla,
)

D = 32


def make(kind, rule, **kw):
    torch.manual_seed(1)
    if kind == "efla":
        layer = EFLA(hidden_size=D, num_heads=2, update_rule=rule, layer_idx=0, **kw)
    elif kind == "efla-gva":  # 4 value heads of dim 8 share 2 query/key heads of dim 16
        layer = EFLA(hidden_size=D, num_heads=2, num_v_heads=4, update_rule=rule, layer_idx=0, **kw)
    elif kind == "gated-gva":  # grouped values: 4 value heads share 2 query/key heads
        layer = GatedEFLA(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1, update_rule=rule, layer_idx=0, **kw)
    else:
        layer = GatedEFLA(hidden_size=D, head_dim=8, num_heads=2, expand_v=2, update_rule=rule, layer_idx=0, **kw)
    for p in layer.parameters():  # random, non-trivial weights (norm weights too)
        if p.dim() == 1 and p is not getattr(layer, "A_log", None) and p is not getattr(layer, "dt_bias", None):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return layer.eval()


class DictCache:
    """Minimal object implementing the layer cache protocol."""

    def __init__(self):
        self.s = {}

    def get_layer_state(self, i):
        return self.s.get(i)

    def update_layer_state(self, i, recurrent_state=None, conv_state=None, offset=1):
        self.s[i] = {"recurrent_state": recurrent_state, "conv_state": conv_state}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# -- architecture ------------------------------------------------------------------------------

EFLA_NAMES = {  # flash-linear-attention DeltaNet layer (use_gate=True adds g_proj)
    "q_proj.weight": (32, 32),
    "k_proj.weight": (32, 32),
    "v_proj.weight": (32, 32),
    "b_proj.weight": (2, 32),
    "q_conv1d.weight": (32, 1, 4),
    "k_conv1d.weight": (32, 1, 4),
    "v_conv1d.weight": (32, 1, 4),
    "g_proj.weight": (32, 32),
    "o_norm.weight": (16,),
    "o_proj.weight": (32, 32),
}
GATED_NAMES = {  # flash-linear-attention GatedDeltaNet layer, head_dim 8, 2 heads, expand_v 2
    "A_log": (2,),
    "dt_bias": (2,),
    "q_proj.weight": (16, 32),
    "k_proj.weight": (16, 32),
    "v_proj.weight": (32, 32),
    "a_proj.weight": (2, 32),
    "b_proj.weight": (2, 32),
    "q_conv1d.weight": (16, 1, 4),
    "k_conv1d.weight": (16, 1, 4),
    "v_conv1d.weight": (32, 1, 4),
    "g_proj.weight": (32, 32),
    "o_norm.weight": (16,),
    "o_proj.weight": (32, 32),
}


@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_parameter_names_match_fla(rule):
    got = {n: tuple(p.shape) for n, p in make("efla", rule, use_gate=True).named_parameters()}
    assert got == EFLA_NAMES
    got = {n: tuple(p.shape) for n, p in make("gated", rule).named_parameters()}
    assert got == GATED_NAMES


@pytest.mark.parametrize("kind", ["efla", "gated", "efla-gva", "gated-gva"])
def test_rules_share_parameters(kind):
    a, b = make(kind, "exact"), make(kind, "euler")
    b.load_state_dict(a.state_dict())  # strict: same names and shapes
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in b.parameters())


def test_bad_arguments():
    with pytest.raises(ValueError, match="update_rule"):
        EFLA(hidden_size=D, num_heads=2, update_rule="rk4")
    with pytest.raises(ValueError, match="num_heads"):
        EFLA(hidden_size=D, num_heads=3)
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedEFLA(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match="^num_v_heads: expected a positive multiple of num_heads = 2"):
        EFLA(hidden_size=D, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match="^num_v_heads: value dim 32 .* not divisible by 6"):
        EFLA(hidden_size=D, num_heads=2, num_v_heads=6)
    layer = make("efla", "exact")
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 5, D + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 5, D), attention_mask=torch.ones(2, 5, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 5, D), attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(2, 5, D), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="past_key_values"):
        layer(torch.randn(2, 5, D), past_key_values=object(), use_cache=True)


# -- only update_rule changes, and exactly as the ops predict ---------------------------


def _manual_features(layer, x):
    """q, k (raw, after conv + SiLU), v, beta, g from the weights, independently of the layer code."""
    B, T, _ = x.shape

    def conv(lin, cv):
        h = lin(x).transpose(1, 2)
        y = F.conv1d(F.pad(h, (cv.weight.shape[-1] - 1, 0)), cv.weight, groups=h.shape[1])
        return F.silu(y.transpose(1, 2))

    H = layer.num_heads
    q = conv(layer.q_proj, layer.q_conv1d).view(B, T, H, -1)
    k = conv(layer.k_proj, layer.k_conv1d).view(B, T, H, -1)
    Hv = getattr(layer, "num_v_heads", H)
    v = conv(layer.v_proj, layer.v_conv1d).view(B, T, Hv, -1)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    g = None
    if isinstance(layer, GatedEFLA):
        g = -torch.exp(layer.A_log) * F.softplus(x @ layer.a_proj.weight.T + layer.dt_bias)
    return q, k, v, beta, g


def _readout(layer, o, x):
    B, T = x.shape[:2]
    if layer.use_gate:
        gate = layer.g_proj(x).view(*o.shape)
        w = layer.o_norm.weight
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * w * F.silu(gate)
    else:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    return layer.o_proj(o.reshape(B, T, -1))


@pytest.mark.parametrize("kind", ["efla", "gated", "efla-gva", "gated-gva"])
def test_update_rule_changes_output_exactly_as_ops_predict(kind):
    exact = make(kind, "exact")
    euler = make(kind, "euler")
    euler.load_state_dict(exact.state_dict())
    with torch.no_grad():  # stiff keys: beta * ||k||^2 well above 2, where the two steps differ a lot
        exact.k_proj.weight.mul_(6.0)
        euler.k_proj.weight.copy_(exact.k_proj.weight)
    x = torch.randn(2, 23, D)
    with torch.no_grad():
        out_exact = exact(x)[0]
        out_euler = euler(x)[0]
        q, k, v, beta, g = _manual_features(exact, x)
        qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        key_norm_sq = (k * k).sum(-1).repeat_interleave(beta.shape[2] // k.shape[2], dim=2)  # per value head
        assert (beta * key_norm_sq).max() > 4.0  # the stiff regime really is exercised
        if kind.startswith("efla"):  # grouped kinds: the ops pair value head i with q/k head i // 2
            o_exact = recurrent_efla(qn, k, v, beta)[0]  # raw keys
            o_euler = recurrent_delta_rule(qn, kn, v, beta)[0]  # normalised keys
        else:
            o_exact = recurrent_gated_efla(qn, k, v, g, beta)[0]
            o_euler = recurrent_gated_delta_rule(qn, kn, v, g, beta)[0]
        pred_exact, pred_euler = _readout(exact, o_exact, x), _readout(euler, o_euler, x)
    assert rel(out_exact, pred_exact) < 1e-5
    assert rel(out_euler, pred_euler) < 1e-5
    assert rel(out_exact - out_euler, pred_exact - pred_euler) < 1e-4
    assert rel(out_exact, out_euler) > 0.05  # and the change is not negligible


# -- decoding, masks, packing ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["efla", "gated", "efla-gva", "gated-gva"])
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_layer_incremental_matches_full(kind, rule):
    layer = make(kind, rule)
    x = torch.randn(2, 19, D)
    with torch.no_grad():
        full = layer(x)[0]
        cache = DictCache()
        parts = [layer(x[:, :7], past_key_values=cache, use_cache=True)[0]]
        for t in range(7, 19):
            parts.append(layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)[0])
    assert rel(torch.cat(parts, 1), full) < 1e-5


@pytest.mark.parametrize("kind", ["efla", "gated", "efla-gva", "gated-gva"])
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_layer_left_padding_and_packing(kind, rule):
    layer = make(kind, rule)
    lens = [11, 4, 7]
    xs = [torch.randn(1, n, D) for n in lens]
    T = max(lens)
    with torch.no_grad():
        singles = [layer(x)[0] for x in xs]
        padded = torch.randn(len(lens), T, D)  # padding holds garbage on purpose
        mask = torch.zeros(len(lens), T, dtype=torch.long)
        for i, x in enumerate(xs):
            padded[i, T - lens[i] :] = x[0]
            mask[i, T - lens[i] :] = 1
        out = layer(padded, attention_mask=mask)[0]
        cu = torch.tensor([0, 11, 15, 22])
        packed = layer(torch.cat(xs, 1), cu_seqlens=cu)[0]
    for i, s in enumerate(singles):
        assert rel(out[i, T - lens[i] :], s[0]) < 1e-5
        assert rel(packed[0, cu[i] : cu[i + 1]], s[0]) < 1e-5
        assert torch.equal(out[i, : T - lens[i]], torch.zeros(T - lens[i], D))


# -- stiffness statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["efla", "gated", "efla-gva", "gated-gva"])
def test_stats(kind):
    exact, euler = make(kind, "exact"), make(kind, "euler")
    euler.load_state_dict(exact.state_dict())
    exact.record_stats = euler.record_stats = True
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        exact(x)
        euler(x)
        q, k, v, beta, g = _manual_features(exact, x)
    k = k.repeat_interleave(exact.num_v_heads // exact.num_heads, dim=2)  # the key each value head reads
    se, sd = exact.stats, euler.stats
    lam = (k * k).sum(-1)
    torch.testing.assert_close(se["stiffness"], beta * lam, rtol=1e-5, atol=1e-6)  # raw keys
    torch.testing.assert_close(sd["key_norm_sq"], torch.ones_like(lam), rtol=1e-4, atol=1e-4)  # unit keys
    torch.testing.assert_close(sd["stiffness"], beta, rtol=1e-4, atol=1e-5)
    b_eff = beta if g is None else beta * g.exp()
    torch.testing.assert_close(se["erase"], efla_coefficient(b_eff, k), rtol=1e-5, atol=1e-6)
    assert (se["transition_eig"] >= -1e-6).all() and (se["transition_eig"] <= 1 + 1e-6).all()  # never expansive
    assert se["stiffness"].shape == (2, 9, exact.num_v_heads)


@pytest.mark.parametrize("kind,head_k_dim,head_v_dim", [("efla-gva", 16, 8), ("gated-gva", 8, 8)])
def test_grouped_value_heads_share_query_key_heads(kind, head_k_dim, head_v_dim):
    """num_v_heads > num_heads: value head j reads query/key head j // (num_v_heads // num_heads)."""
    layer = make(kind, "exact")
    x = torch.randn(1, 7, D)
    with torch.no_grad():
        q, k, v, *_ = layer.prepare_qkv_beta(x)
        kq = layer.k_proj(x)  # the un-repeated key projection has num_heads * head_k_dim columns
    assert q.shape == (1, 7, 4, head_k_dim) and v.shape == (1, 7, 4, head_v_dim) and kq.shape[-1] == 2 * head_k_dim
    assert torch.equal(k[:, :, 0], k[:, :, 1]) and torch.equal(k[:, :, 2], k[:, :, 3])
    assert not torch.equal(k[:, :, 1], k[:, :, 2])


def test_grouped_efla_layer_has_one_beta_and_norm_per_value_head():
    got = {n: tuple(p.shape) for n, p in make("efla-gva", "exact").named_parameters()}
    assert got["b_proj.weight"] == (4, D) and got["o_norm.weight"] == (8,)
    assert got["v_proj.weight"] == (D, D) and got["k_proj.weight"] == (D, D)
