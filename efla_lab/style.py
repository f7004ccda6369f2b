"""How the lab draws the four update rules: one colour each, the same in every figure."""

from __future__ import annotations

from efla.variants import Variant

COLOURS = {"exact": "tab:red", "euler": "tab:blue", "gated-exact": "tab:orange", "gated-euler": "tab:cyan"}


def colour(name: str) -> str:
    """The plot colour of a rule under any of its spellings."""
    return COLOURS[Variant.parse(name).key]
