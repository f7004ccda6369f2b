"""Checks of command-line values made before any work starts; each failure is a :class:`UsageError`
naming the option."""

from __future__ import annotations

import os

from efla.errors import UsageError


def at_least(value, minimum, option: str) -> None:
    """``value`` (or each of a list of values) is ``None`` or ``>= minimum``."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and v < minimum:
            raise UsageError(f"expected a value >= {minimum:g}, got {v:g} ({option})")


def positive(value, option: str) -> None:
    """``value`` (or each of a list of values) is ``None`` or ``> 0``."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and not v > 0:
            raise UsageError(f"expected a value > 0, got {v:g} ({option})")


def existing_file(path: str | None, option: str) -> None:
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory, expected a file ({option})")
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path} ({option})")


def existing_dir(path: str | None, option: str) -> None:
    if path is None:
        return
    if not os.path.exists(path):
        raise UsageError(f"no such directory: {path} ({option})")
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory ({option})")


def output_dir(path: str, option: str = "--out") -> None:
    """``path`` is a directory or can become one (nothing in the way)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{path} exists and is not a directory ({option})")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{parent} is not a directory, so {path} cannot be created ({option})")


def device(name: str, option: str = "--device") -> None:
    import torch  # noqa: PLC0415 (lazy: option checks answer before torch loads)

    kind = name.split(":")[0]
    if kind not in ("auto", "cpu", "cuda"):
        raise UsageError(f"unknown device {name!r}; expected cpu or cuda ({option})")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{name} requested but no CUDA device is available ({option})")
