"""Every environment variable efla reads, declared once, and the one place that reads them.

``get("EFLA_DIRECT_LAUNCH")`` answers a variable's typed value. All are parsed when this module
loads and kept, so the kernels' launches and the ops' calls never touch ``os.environ``;
``reload()`` reads them again after the environment changed, and ``override(EFLA_SPLIT_STATE=4)``
switches values inside one process for a block (tests, benchmarks). ``docs/environment.md`` is the
table of ``VARIABLES`` (``python -m efla.environment`` prints it).

On/off switches share one spelling: on is ``1``, ``true``, ``on`` or ``yes``; off is ``0``,
``false``, ``off``, ``no`` or empty; in any case, surrounding spaces ignored. Any other value raises
a ``ValueError`` naming the variable, the value and what it accepts. A variable that belongs to
another program (Triton, torchrun) is read the way its owner reads it, so the two never disagree.

It imports the standard library only: nothing heavy to load, and no import cycle with the rest of efla.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no", "")
_SPELLINGS = "on (1, true, on, yes) or off (0, false, off, no, empty), in any case"


def parse_switch(name: str, text: str) -> bool:
    """An on/off switch in efla's spelling (the module's docstring)."""
    word = text.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise ValueError(f"{name}={text!r}: expected {_SPELLINGS}")


def _pieces(name: str, text: str) -> int:
    word = text.strip().lower()
    if word.isascii() and word.isdigit():
        return int(word)
    if word in OFF:
        return 0
    raise ValueError(f"{name}={text!r}: expected a number of pieces per sequence (0 or 1: not split) or off")


def _key_check_mode(name: str, text: str) -> str:
    word = text.strip().lower()
    if word in ("later", "sync", "off"):
        return word
    try:
        return "later" if parse_switch(name, word) else "off"
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected later, sync or off ({_SPELLINGS}; on means later)") from None


def _tritons_switch(_name: str, text: str) -> bool:
    """Triton's own reading of its switches (``getenv_bool``): anything else is off, not an error."""
    return text.lower() in ("1", "true", "on", "yes", "y")


def _integer(least: int) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < least:
            raise ValueError(f"{name}={text!r}: expected a whole number of at least {least}")
        return value

    return parse


def _text(_name: str, text: str) -> str | None:
    return text or None  # set but empty: as if unset


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # as docs/environment.md states it
    default: object  # the value while the variable is unset
    meaning: str  # one line
    parse: Callable[[str, str], object]  # (name, text) -> value, or ValueError
    owner: str = "efla"  # the program that defines it, where efla only reads another's
    experimental: bool = False  # off by default and kept off the default code path (efla.ops.cuda.experimental)

    def read(self, text: str | None):
        return self.default if text is None else self.parse(self.name, text)


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {variable.name: variable for variable in variables}


VARIABLES = _declare(
    Variable(
        "EFLA_CHECK_VALUES",
        "switch",
        False,
        "On a GPU, check the ops' input values (NaN/Inf, signs, key norms) and results, one device sync per "
        "check (the CPU always checks them).",
        parse_switch,
    ),
    Variable(
        "EFLA_CHECK_KEYS",
        "later, sync or off",
        "later",
        "When the GPU chunk kernels' flag for keys whose squared norm overflows float32 is read: behind the "
        "kernels (`later`), at each call with a device sync (`sync`, also `on`), or never, NaN passing (`off`).",
        _key_check_mode,
    ),
    Variable(
        "EFLA_DIRECT_LAUNCH",
        "switch",
        True,
        "A Triton launch after the first of its specialisation goes straight to the compiled kernel, "
        "without Triton's per-call Python.",
        parse_switch,
    ),
    Variable(
        "EFLA_FLA_KERNELS",
        "switch",
        True,
        "The layers hand norms, short convolutions, SwiGLU, the decay gate and the loss to fla's fused "
        "kernels on CUDA tensors (`efla.layers.fla_kernels.set_enabled` overrides it).",
        parse_switch,
    ),
    Variable(
        "EFLA_FUSED_FORWARD",
        "switch",
        False,
        "The chunk forward's state and output passes as one kernel; refused together with EFLA_SPLIT_STATE.",
        parse_switch,
        experimental=True,
    ),
    Variable(
        "EFLA_SPLIT_STATE",
        "pieces",
        0,
        "The chunk state passes of a dense batch walk each sequence in about this many pieces side by side (0 or 1: whole).",
        _pieces,
        experimental=True,
    ),
    Variable(
        "EFLA_STATE_TUNING",
        "switch",
        False,
        "fla's state-pass kernels get a launch setting tuned per power-of-two bucket of sequences x heads.",
        parse_switch,
        experimental=True,
    ),
    Variable(
        "EFLA_DEBUG",
        "switch",
        False,
        "The command line prints an error's full traceback, not one line (as `--debug`).",
        parse_switch,
    ),
    Variable(
        "EFLA_DATA_DIR",
        "path",
        None,
        "The first folder searched for shared data (MNIST, evaluation corpora), before `../shared/data`.",
        _text,
    ),
    Variable(
        "EFLA_API_KEY",
        "secret",
        None,
        "The bearer key `efla serve` asks for (`--api-key` overrides it; empty: none asked for).",
        _text,
    ),
    Variable(
        "TRITON_INTERPRET",
        "switch",
        False,
        "Triton runs its kernels in its CPU interpreter; efla then tunes over one launch setting per kernel and "
        "launches through Triton. Read as Triton reads it: on is 1, true, on, yes or y in any case, anything else off.",
        _tritons_switch,
        owner="Triton",
    ),
    Variable(
        "WORLD_SIZE",
        "integer",
        1,
        "Processes of a `torchrun` training run; above 1 `efla train` joins their process group.",
        _integer(1),
        owner="torchrun",
    ),
    Variable(
        "LOCAL_RANK",
        "integer",
        0,
        "This process's GPU on its machine in a `torchrun` training run.",
        _integer(0),
        owner="torchrun",
    ),
)

_lock = threading.Lock()  # override() and reload(); get() reads without it


@dataclass(frozen=True)
class _BadValue:
    """A variable whose text its parser refused: ``get`` raises this message for it alone, so one
    mistyped switch does not break ``import efla`` for everything else."""

    message: str


def _parse_environment() -> dict:
    parsed = {}
    for name, declared in VARIABLES.items():
        try:
            parsed[name] = declared.read(os.environ.get(name))
        except ValueError as error:
            parsed[name] = _BadValue(str(error))
    return parsed


_parsed: dict = _parse_environment()  # name -> value, every declared variable, as of the last reload
_overrides: list[dict] = []  # the open override() blocks' values, innermost last
_current: dict = dict(_parsed)  # what get() answers: _parsed under the overrides


def get(name: str):
    """The value of the declared variable ``name``, as parsed at import or at the last ``reload()``,
    unless an ``override()`` block sets it. A plain lookup in a dict that is replaced, never changed,
    so that code torch.compile traces reads it as a constant and recompiles only after a change."""
    try:
        value = _current[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in efla.environment") from None
    if isinstance(value, _BadValue):
        raise ValueError(value.message)
    return value


def variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in efla.environment") from None


def reload() -> None:
    """Read every variable from the environment again, under the open ``override()`` blocks."""
    global _parsed
    with _lock:
        _parsed = _parse_environment()
        _rebuild()


@contextlib.contextmanager
def override(**values) -> Iterator[None]:
    """Inside the block ``get`` answers these values, for every thread: ``override(EFLA_SPLIT_STATE=4)``
    or ``override(EFLA_SPLIT_STATE="4")`` (text as the environment would hold it; ``None``: as if
    unset). Each value is checked as the environment's would be, on entry. Blocks nest."""
    layer = {name: _value_of(name, value) for name, value in values.items()}
    with _lock:
        _overrides.append(layer)
        _rebuild()
    try:
        yield
    finally:
        with _lock:
            del _overrides[next(i for i, open_layer in enumerate(_overrides) if open_layer is layer)]
            _rebuild()


def _value_of(name: str, value):
    """A value given to ``override`` as ``get`` will answer it, checked by the variable's parser."""
    declared = variable(name)
    if value is None or isinstance(value, str):
        return declared.read(value)
    if isinstance(value, bool):
        return declared.read("1" if value else "0")
    if isinstance(value, int):
        return declared.read(str(value))
    if isinstance(value, os.PathLike):
        return declared.read(os.fspath(value))
    raise TypeError(f"{name}: expected a str, bool, int, path or None, got {type(value).__name__}")


def _rebuild() -> None:
    global _current
    current = dict(_parsed)
    for layer in _overrides:
        current.update(layer)
    _current = current


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def table() -> str:
    """``VARIABLES`` as docs/environment.md's table (markdown)."""
    lines = ["| Name | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        kind = v.type if v.owner == "efla" else f"{v.type} ({v.owner}'s)"
        meaning = ("*Experimental.* " if v.experimental else "") + v.meaning
        lines.append(f"| `{v.name}` | {kind} | {_shown(v.default)} | {meaning} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
