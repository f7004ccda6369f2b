"""``efla convert`` of flash-linear-attention Gated DeltaNet checkpoints with grouped value heads."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import efla  # noqa: F401  (registers the model type)
from efla.models.convert import convert_fla_checkpoint
from tests.interpreter import interpreter_ready

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "fla_gated_deltanet"  # saved by flash-linear-attention 0.6.0


def fla_value_head_shapes(cfg: dict, num_v_heads: int) -> dict[str, tuple]:
    """The shapes of fla's ``GatedDeltaNet`` layer tensors that follow the value heads
    (value width ``num_v_heads * head_dim * expand_v``; one gate and one beta per value head)."""
    hidden = cfg["hidden_size"]
    value_dim = int(num_v_heads * cfg["head_dim"] * cfg["expand_v"])
    return {
        "v_proj.weight": (value_dim, hidden),
        "v_conv1d.weight": (value_dim, 1, cfg["conv_size"]),
        "g_proj.weight": (value_dim, hidden),
        "o_proj.weight": (hidden, value_dim),
        "a_proj.weight": (num_v_heads, hidden),
        "b_proj.weight": (num_v_heads, hidden),
        "A_log": (num_v_heads,),
        "dt_bias": (num_v_heads,),
    }


def grouped_fla_checkpoint(dst: pathlib.Path, num_v_heads: int, config_v_heads: int | None = None) -> dict:
    """The fixture turned into an fla checkpoint with ``num_v_heads`` value heads (tensors) whose
    config says ``config_v_heads`` (default: the same)."""
    dst.mkdir()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in fla_value_head_shapes(cfg, num_v_heads).items():
            tensors[f"model.layers.{i}.attn.{name}"] = torch.randn(shape, generator=gen)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg["num_v_heads"] = num_v_heads if config_v_heads is None else config_v_heads
    (dst / "config.json").write_text(json.dumps(cfg))
    return tensors


@pytest.mark.parametrize("rule", ["euler", "exact"])
def test_convert_grouped_gated_deltanet_maps_every_tensor(tmp_path, rule):
    original = grouped_fla_checkpoint(tmp_path / "fla", num_v_heads=4)  # the fixture has 2 q/k heads
    convert_fla_checkpoint(tmp_path / "fla", tmp_path / "out", update_rule=rule)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert model.config.num_v_heads == 4 and model.config.num_heads == 2
    ours = model.state_dict()
    assert set(ours) == set(original)
    for k, v in original.items():
        assert torch.equal(ours[k], v), k
    with torch.no_grad():
        out = model(torch.randint(0, 64, (1, 9)), use_cache=True)
    state = (out.cache if hasattr(out, "cache") else out.past_key_values)[0]["recurrent_state"]
    assert state.shape == (1, 4, 16, 32) and torch.isfinite(out.logits).all()


def test_convert_refuses_value_heads_that_disagree_with_the_config(tmp_path):
    grouped_fla_checkpoint(tmp_path / "fla", num_v_heads=4, config_v_heads=2)
    with pytest.raises(ValueError, match=r"wrong shape 16: .*attn.A_log: checkpoint \(4,\), model \(2,\)"):
        convert_fla_checkpoint(tmp_path / "fla", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_value_heads_not_a_multiple_of_heads(tmp_path):
    grouped_fla_checkpoint(tmp_path / "fla", num_v_heads=3)
    with pytest.raises(ValueError, match="^num_v_heads: expected a multiple of num_heads = 2"):
        convert_fla_checkpoint(tmp_path / "fla", tmp_path / "out")


# ------------------------------------------------------- against fla's own model (Triton interpreter)
_READY, _WHY = interpreter_ready()

# fla's Gated DeltaNet with 4 value heads on 2 q/k heads, run by fla's own kernels, against the
# converted Euler model: equal logits only if both pair value and q/k heads the same way.
_FLA_MODEL_SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, tempfile, torch
    from tests.layers.fused_checks import prepare_interpreter
    prepare_interpreter()
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from efla.models.convert import convert_fla_checkpoint
    from efla.models import EFLAForCausalLM
    torch.manual_seed(0)
    cfg = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, num_v_heads=4, head_dim=8,
                              expand_v=1, vocab_size=64, fuse_cross_entropy=False)
    fla_model = GatedDeltaNetForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in fla_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tmp = pathlib.Path(tempfile.mkdtemp())
    fla_model.save_pretrained(tmp / "fla")
    convert_fla_checkpoint(tmp / "fla", tmp / "efla", update_rule="euler")
    ours = EFLAForCausalLM.from_pretrained(tmp / "efla").eval()
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        want, got = fla_model(ids).logits, ours(ids).logits
    print("REL", ((got - want).norm() / want.norm()).item())
    """
)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_converted_grouped_model_matches_fla_model_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _FLA_MODEL_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rel = float(r.stdout.split("REL")[-1])
    assert rel < 1e-5, rel
