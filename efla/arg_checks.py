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


def known_keys(fields: dict, known, path: str, option: str) -> None:
    """Every key of ``fields`` (a mapping read from the file ``path``) is one of ``known``: a misspelt key
    would otherwise be dropped without a word. The error names the key, the file, its line when the key is
    found in the text, and the nearest known key."""
    import difflib  # noqa: PLC0415 (lazy: only files with keys need it)

    for key in fields:
        if key in known:
            continue
        nearest = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
        raise UsageError(f"{place_of_key(path, key)}: unknown key {key!r}{hint} ({option})")


def place_of_key(path: str, key: str) -> str:
    """``path:N``, with N the first line of ``path`` where ``key`` is written as a key (``path`` alone when
    it is not found: the parsers we use give no line for a key)."""
    import re  # noqa: PLC0415

    written = re.compile(rf"""["']?{re.escape(key)}["']?\s*[:=]""")
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if written.search(line):
                    return f"{path}:{number}"
    except (OSError, UnicodeDecodeError):
        pass
    return path


def given(args, dest: str) -> bool:
    """The option stored in ``args.<dest>`` was on the command line (``efla.cli`` records them)."""
    return dest in getattr(args, "given_options", ())


def not_ignored(args, options: dict[str, str], because: str) -> None:
    """Refuses any of ``options`` (``{dest: "--option"}``) given on the command line when the command would
    ignore it ``because`` of another choice: a value silently dropped is a mistake found too late."""
    for dest, option in options.items():
        if given(args, dest):
            raise UsageError(f"{option} has no effect {because} ({option})")
