"""The pages a user reads: the README and the documentation site's pages, every markdown file under
docs/ at any depth except docs/results, the experiments' records, of which only claims.md (the
verdicts on the paper's claims) is a page."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"


def site_pages() -> list[pathlib.Path]:
    pages = [page for page in DOCS.rglob("*.md") if RESULTS not in page.parents]
    return sorted([*pages, RESULTS / "claims.md"])


def doc_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *site_pages()]


def doc_text() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in doc_pages())
