"""``efla convert``: flash-linear-attention checkpoints map one-to-one onto efla models."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import efla  # noqa: F401  (registers the model type)
from efla.cli import main
from efla.models.convert import convert_fla_checkpoint

FIXTURES = pathlib.Path(__file__).parent / "fixtures"  # saved by flash-linear-attention 0.6.0 itself


def assert_same_tensors_and_runs(model, original: dict) -> None:
    """Every tensor of the fla checkpoint, and no other, in the model; and the model runs."""
    ours = model.state_dict()
    assert set(ours) == set(original)
    for k, v in original.items():
        assert torch.equal(ours[k], v), k
    logits = model(torch.randint(0, 64, (2, 11))).logits
    assert logits.shape == (2, 11, 64) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name,gated", [("fla_delta_net", False), ("fla_gated_deltanet", True)])
@pytest.mark.parametrize("rule", ["euler", "exact"])
def test_convert_fla_checkpoint_every_parameter_equal(tmp_path, name, gated, rule):
    src = FIXTURES / name
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst), "--update-rule", rule]) == 0
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.config.model_type == "efla" and model.config.gated is gated and model.config.update_rule == rule
    original = load_file(str(src / "model.safetensors"))
    assert_same_tensors_and_runs(model, original)


def test_euler_and_exact_conversions_differ_only_in_the_rule(tmp_path):
    src = FIXTURES / "fla_delta_net"
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    outs = {}
    for rule in ("euler", "exact"):
        convert_fla_checkpoint(src, tmp_path / rule, update_rule=rule)
        outs[rule] = AutoModelForCausalLM.from_pretrained(tmp_path / rule).eval()(ids).logits
    assert not torch.allclose(outs["euler"], outs["exact"], atol=1e-6)


def _copy(src, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def test_convert_refuses_missing_unexpected_and_misshaped_tensors(tmp_path):
    src = _copy(FIXTURES / "fla_delta_net", tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    bad = dict(tensors)
    bad.pop("model.layers.1.attn.b_proj.weight")
    bad["model.layers.0.attn.extra.weight"] = torch.randn(3)
    bad["model.norm.weight"] = torch.randn(7)
    save_file(bad, str(src / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        convert_fla_checkpoint(src, tmp_path / "out")
    msg = str(e.value)
    assert "missing 1: model.layers.1.attn.b_proj.weight" in msg
    assert "unexpected 1: model.layers.0.attn.extra.weight" in msg
    assert "wrong shape 1: model.norm.weight: checkpoint (7,), model (32,)" in msg
    assert not (tmp_path / "out").exists()


def test_convert_refuses_other_model_types_and_per_layer_attention_settings(tmp_path):
    src = _copy(FIXTURES / "fla_delta_net", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(ValueError, match="model_type 'delta_net' or 'gated_deltanet'"):
        convert_fla_checkpoint(src, tmp_path / "o1")
    two_specs = [{"layers": [0], "num_heads": 2}, {"layers": [1], "num_heads": 4}]
    (src / "config.json").write_text(json.dumps(dict(cfg, attn=two_specs)))
    with pytest.raises(ValueError, match="2 attention specifications"):
        convert_fla_checkpoint(src, tmp_path / "o2")
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pickle"):
        convert_fla_checkpoint(src, tmp_path / "o3")


# how fla 0.6.0 saves a hybrid DeltaNet: its `attn` dict with every default filled in, and the
# attention blocks' q/k/v/o projections (q/k/v biases with qkv_bias) under the block's `attn`
FLA_HYBRID_ATTN = {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": None, "rope_theta": 10000.0}


def _fla_hybrid_checkpoint(tmp_path, attn):
    src = _copy(FIXTURES / "fla_delta_net", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, attn=attn)))
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("model.layers.1.attn.")}
    D = cfg["hidden_size"]
    kv_dim = FLA_HYBRID_ATTN["num_kv_heads"] * D // FLA_HYBRID_ATTN["num_heads"]
    gen = torch.Generator().manual_seed(0)
    for name, shape in [
        ("q_proj.weight", (D, D)),
        ("q_proj.bias", (D,)),
        ("k_proj.weight", (kv_dim, D)),
        ("k_proj.bias", (kv_dim,)),
        ("v_proj.weight", (kv_dim, D)),
        ("v_proj.bias", (kv_dim,)),
        ("o_proj.weight", (D, D)),
    ]:
        tensors[f"model.layers.1.attn.{name}"] = torch.randn(shape, generator=gen) * 0.1
    save_file(tensors, str(src / "model.safetensors"))
    return src, tensors


@pytest.mark.parametrize("as_list", [False, True])
def test_convert_fla_hybrid_checkpoint(tmp_path, capsys, as_list):
    src, original = _fla_hybrid_checkpoint(tmp_path, [FLA_HYBRID_ATTN] if as_list else FLA_HYBRID_ATTN)
    assert main(["convert", str(src), str(tmp_path / "out"), "--update-rule", "euler"]) == 0
    assert "Softmax-attention layers (unchanged by --update-rule): [1]" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.attn == FLA_HYBRID_ATTN
    attention = model.model.layers[1].attn
    assert (type(attention).__name__, attention.num_heads, attention.num_kv_heads) == ("Attention", 4, 2)
    assert_same_tensors_and_runs(model, original)


def test_convert_hybrid_refuses_attention_tensors_of_the_wrong_shape(tmp_path):
    src, _ = _fla_hybrid_checkpoint(tmp_path, dict(FLA_HYBRID_ATTN, num_kv_heads=4))
    expected = r"wrong shape 4: model.layers.1.attn.k_proj.bias: checkpoint \(16,\), model \(32,\)"
    with pytest.raises(ValueError, match=expected):
        convert_fla_checkpoint(src, tmp_path / "out")


def _fla_available() -> bool:
    try:
        import fla.models  # noqa: F401

        return True
    except Exception:  # noqa: BLE001  a partial fla install counts as none
        return False


@pytest.mark.skipif(not _fla_available(), reason="flash-linear-attention is not installed (pip install 'efla[cuda]')")
def test_convert_live_fla_model(tmp_path):
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    torch.manual_seed(0)
    fla_model = DeltaNetForCausalLM(
        DeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=100, use_gate=True)
    )
    fla_model.save_pretrained(tmp_path / "fla")
    convert_fla_checkpoint(tmp_path / "fla", tmp_path / "efla", update_rule="euler")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "efla").state_dict()
    for k, v in fla_model.state_dict().items():
        assert torch.equal(ours[k], v), k
