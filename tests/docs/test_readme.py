"""Every Python example in the README and the docs pages runs (CPU, small sizes)."""

from __future__ import annotations

import re

import pytest

from tests.doc_pages import doc_text

BLOCKS = re.findall(r"```python\n(.*?)```", doc_text(), re.S)


def test_readme_has_examples():
    assert BLOCKS, "the docs have no ```python examples"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[i], f"docs[python block {i}]", "exec"), {"__name__": "__readme__"})


def _cli_lines():
    blocks = re.findall(r"```bash\n(.*?)```", doc_text(), re.S)
    lines = []
    for b in blocks:
        for line in b.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("efla "):
                lines.append(line)
    return lines


def test_readme_cli_examples_parse():
    """Every `efla ...` line in the README names a real subcommand with accepted options."""
    import shlex

    from efla.cli import build_parser

    lines = _cli_lines()
    assert lines
    parser = build_parser()
    for line in lines:
        args = parser.parse_args(shlex.split(line)[1:])
        assert callable(args.func), line
