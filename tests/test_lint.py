"""The code passes the linter configured in pyproject.toml ([tool.ruff]) and is as its formatter leaves it."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (it is in the test extra)")
def test_ruff_check_is_clean():
    result = subprocess.run(
        ["ruff", "check", "--no-cache", "efla", "efla_lab", "tests", "benchmarks", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (it is in the test extra)")
def test_ruff_format_leaves_the_code_as_it_is():
    result = subprocess.run(
        ["ruff", "format", "--check", "--no-cache", "efla", "efla_lab", "tests", "benchmarks", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
