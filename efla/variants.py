"""The four update rules (exact or Euler step, plain or gated) and every name each one goes by.

Op names, preset suffixes, experiment keys ("gated-exact"), and the (update_rule, gated) pair used by
layer configs all denote the same four rules; `Variant.parse` accepts any of them so callers never
decode a rule from its spelling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    exact: bool
    gated: bool
    op_name: str
    preset_suffix: str
    label: str

    @property
    def update_rule(self) -> str:
        return "exact" if self.exact else "euler"

    @property
    def key(self) -> str:
        """Experiment key: "exact", "euler", "gated-exact", "gated-euler"."""
        return ("gated-" if self.gated else "") + self.update_rule

    @property
    def model_name(self) -> str:
        """A model config's variant: "efla", "deltanet", "gated_efla", "gated_deltanet"."""
        return self.preset_suffix.replace("-", "_")

    @property
    def euler_counterpart(self) -> Variant:
        """The Euler rule this one is compared with (itself for the Euler rules)."""
        return Variant.of("euler", self.gated)

    def spellings(self) -> set[str]:
        names = {self.key, self.op_name, self.preset_suffix, self.op_name.replace("_", "-")}
        return {n.lower() for n in names}

    @classmethod
    def of(cls, update_rule: str, gated: bool) -> Variant:
        return cls.parse(("gated-" if gated else "") + update_rule)

    @classmethod
    def parse(cls, name: str) -> Variant:
        wanted = name.strip().lower().replace("_", "-")
        for variant in VARIANTS:
            if wanted in {s.replace("_", "-") for s in variant.spellings()}:
                return variant
        known = ", ".join(sorted(s for v in VARIANTS for s in v.spellings()))
        raise ValueError(f"unknown update rule {name!r}; expected one of {known}")


EFLA = Variant(True, False, "efla", "efla", "EFLA")
EULER = Variant(False, False, "delta_rule", "deltanet", "DeltaNet")
GATED_EFLA = Variant(True, True, "gated_efla", "gated-efla", "Gated EFLA")
GATED_EULER = Variant(False, True, "gated_delta_rule", "gated-deltanet", "Gated DeltaNet")
VARIANTS = (EFLA, EULER, GATED_EFLA, GATED_EULER)
EXPERIMENT_KEYS = tuple(v.key for v in VARIANTS)  # "exact", "euler", "gated-exact", "gated-euler"


def label(name: str, default: str | None = None) -> str:
    """The display label of a rule under any of its spellings ("exact", "deltanet", "gated_efla", ...);
    ``default`` (when given) for a name that is no rule."""
    try:
        return Variant.parse(name).label
    except ValueError:
        if default is None:
            raise
        return default
