"""The documentation site (mkdocs.yml) builds with warnings as errors, lists every page in its
navigation, and its API reference is rendered from the code's docstrings."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.doc_pages import DOCS, ROOT, site_pages


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """One strict build for the module's tests: (the finished process, the site directory)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]" (the test extra includes it)')
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return build, site_dir


def test_site_builds_strict(site):
    build, _ = site
    tail = (build.stdout + build.stderr)[-6000:]
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{tail}"
    # mkdocs reports a link to a file left out of the site (docs/results' records) at INFO, not as a
    # warning: it would be a dead link on the site
    dead = [line for line in (build.stdout + build.stderr).splitlines() if "excluded from the built site" in line]
    assert dead == [], "\n".join(dead)


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, dict):
        return [page for value in entry.values() for page in _nav_pages(value)]
    return [page for item in entry for page in _nav_pages(item)]


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = [page.relative_to(DOCS).as_posix() for page in site_pages()]
    assert sorted(set(pages) - set(nav)) == [], "pages under docs/ missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries that are not pages (tests/doc_pages.py's site_pages)"
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def test_reference_renders_an_op_from_its_docstring(site):
    """``chunk_efla`` is made at import (its docstring filled from a template), the case static
    analysis alone renders as a bare name: its page must show its signature and docstring."""
    from efla.ops import chunk_efla

    build, site_dir = site
    assert build.returncode == 0, "the site did not build (see test_site_builds_strict)"
    page = (site_dir / "reference" / "ops" / "index.html").read_text(encoding="utf-8")
    start = page.find('id="efla.ops.chunk_efla"')
    assert start >= 0, "no entry for efla.ops.chunk_efla on the reference page"
    heading_tag_end = page.find(">", start) + 1
    entry = _text(page[heading_tag_end : page.find('class="doc doc-heading"', heading_tag_end)])
    first_line = chunk_efla.__doc__.strip().splitlines()[0]
    assert "chunk_efla(q,k,v,beta,*,scale=None," in "".join(entry.split()), entry[:500]
    assert first_line in entry, entry[:500]
    assert "use_qk_l2norm_in_kernel" in entry and "Returns" in entry, entry[:500]
