"""The pages a user reads: the README and the topic pages under docs/ (not docs/results, the records)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def doc_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_text() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in doc_pages())
