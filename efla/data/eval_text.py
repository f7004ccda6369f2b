"""The evaluation texts of ``efla eval``: WikiText (a raw file, or a ``datasets`` name when online) and
LAMBADA (OpenAI JSONL), and where their default copies are found."""

from __future__ import annotations

import json
import os

from efla.data.shared import find_shared

__all__ = ["load_text", "load_lambada", "default_data_file"]

_DATA_FILES = {"wikitext": ("wikitext-2-raw", "wiki.test.raw"), "lambada": ("lambada", "lambada_test.jsonl")}


def default_data_file(kind: str) -> str | None:
    """``wiki.test.raw`` (``kind="wikitext"``) or ``lambada_test.jsonl`` in a shared data folder, if present."""
    found = find_shared(*_DATA_FILES[kind])
    return str(found) if found else None


def load_text(spec: str) -> tuple[str, str]:
    """``(text, source)`` from a local file, or a Hugging Face ``datasets`` name when online
    (``NAME[:CONFIG[:SPLIT]]``, default split ``test``; rows of its ``text`` column are joined as
    lines, e.g. ``Salesforce/wikitext:wikitext-2-raw-v1``)."""
    if os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{spec}: not UTF-8 text (byte offset {e.start}) (--wikitext)") from None
        if not text.strip():
            raise ValueError(f"{spec}: the file is empty (--wikitext)")
        return text, os.path.abspath(spec)
    if os.path.exists(spec) or spec.startswith((".", "/")) or spec.endswith((".raw", ".txt", ".jsonl")):
        raise FileNotFoundError(f"--wikitext: no such file: {spec}")
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise FileNotFoundError(f"--wikitext: {spec!r} is not a file and the `datasets` package is not installed") from e
    name, config, split = (spec.split(":") + [None, None])[:3]
    ds = datasets.load_dataset(name, config, split=split or "test")
    rows = ds["text"]
    text = "".join(r if r.endswith("\n") else r + "\n" for r in rows)
    return text, f"datasets:{spec}"


def load_lambada(path: str, limit: int | None = None) -> list[str]:
    """Passages of an OpenAI-format LAMBADA JSONL file (one ``{"text": ...}`` per line), the first ``limit``."""
    texts = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for i, line in enumerate(_lines_naming_file(f, path)):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not a JSON line ({e.msg}, column {e.colno}) (--lambada)") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a string 'text' field (--lambada)")
            texts.append(obj["text"])
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path}: no passages (--lambada)")
    return texts


def _lines_naming_file(f, path: str):
    n = 0
    try:
        for n, line in enumerate(f, 1):  # noqa: B007
            yield line
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{n + 1}: not UTF-8 text ({e.reason}) (--lambada)") from None
