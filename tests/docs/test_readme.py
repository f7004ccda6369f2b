"""Every Python example in the README runs (CPU, small sizes)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert BLOCKS, "README.md has no ```python examples"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), {"__name__": "__readme__"})


def _cli_lines():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
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
