import pytest

from efla.variants import EFLA, EULER, GATED_EFLA, GATED_EULER, VARIANTS, Variant


@pytest.mark.parametrize(
    "name, expected",
    [
        ("exact", EFLA),
        ("efla", EFLA),
        ("euler", EULER),
        ("delta_rule", EULER),
        ("deltanet", EULER),
        ("gated-exact", GATED_EFLA),
        ("gated_efla", GATED_EFLA),
        ("gated-efla", GATED_EFLA),
        ("gated-euler", GATED_EULER),
        ("gated_delta_rule", GATED_EULER),
        ("gated-deltanet", GATED_EULER),
    ],
)
def test_every_spelling_names_one_rule(name, expected):
    assert Variant.parse(name) is expected


def test_update_rule_and_gate_round_trip():
    for variant in VARIANTS:
        assert Variant.of(variant.update_rule, variant.gated) is variant


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown update rule"):
        Variant.parse("mamba")
