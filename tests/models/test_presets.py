"""Presets and parameter counts. Large models are built on the meta device."""

import pytest
import torch

from efla.models import PRESETS, EFLAForCausalLM, get_preset_config, preset_names


def count(name: str) -> int:
    with torch.device("meta"):
        model = EFLAForCausalLM(get_preset_config(name))
    return sum(p.numel() for p in model.parameters())


def test_preset_names():
    names = preset_names()
    assert len(names) == 13 and set(names) == set(PRESETS)
    for size in ("tiny", "340m", "1.3b"):
        for variant in ("efla", "gated-efla", "deltanet", "gated-deltanet"):
            assert f"{size}-{variant}" in names
    assert "tiny-hybrid-efla" in names


@pytest.mark.parametrize("size", ["tiny", "340m", "1.3b"])
def test_efla_and_deltanet_have_identical_parameters(size):
    counts = {v: count(f"{size}-{v}") for v in ("efla", "deltanet", "gated-efla", "gated-deltanet")}
    assert counts["efla"] == counts["deltanet"]
    assert counts["gated-efla"] == counts["gated-deltanet"]
    print(f"\n{size}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))


def test_paper_sizes():
    """340M / 1.3B presets: the architecture the issue fixes, and counts in the named range."""
    c340, c13 = get_preset_config("340m-efla"), get_preset_config("1.3b-efla")
    assert (c340.hidden_size, c340.num_hidden_layers, c340.num_heads, c340.hidden_size // c340.num_heads) == (1024, 24, 8, 128)
    assert (c13.hidden_size, c13.num_hidden_layers, c13.num_heads, c13.hidden_size // c13.num_heads) == (2048, 24, 16, 128)
    g = get_preset_config("340m-gated-efla")
    assert (g.head_dim, g.num_heads, g.gated, g.update_rule) == (128, 8, True, "exact")
    # exact counts (embeddings 32000 x D twice, untied); recorded in the step-2 report
    assert count("340m-efla") == 374_362_112
    assert count("1.3b-efla") == 1_365_677_056
    assert count("340m-gated-efla") == 371_875_936
    assert count("1.3b-gated-efla") == 1_355_789_760


@pytest.mark.parametrize("size", ["340m", "1.3b"])
def test_gated_presets_match_the_ungated_size(size):
    """The output gate's projection is paid for with depth: within 1% of the ungated count, not above it."""
    ungated, gated = count(f"{size}-efla"), count(f"{size}-gated-efla")
    assert 0.99 * ungated <= gated <= ungated
    assert get_preset_config(f"{size}-gated-efla").num_hidden_layers == 22


def test_parts_add_up():
    model = EFLAForCausalLM(get_preset_config("tiny-gated-efla"))
    parts = model.num_parameters_by_part()
    assert sum(v for k, v in parts.items() if k != "total") == parts["total"] == model.num_parameters()
