"""A new user types the README's command lines with mistakes: a missing path, a bad option value, an unknown
option. Each is one line ``efla <command>: <what> (<option or file>)`` on stderr, exit status 2, and leaves
the working directory as it was (no --out made)."""

from __future__ import annotations

import argparse
import pathlib
import re
import shlex

import pytest

from efla import cli
from tests.doc_pages import doc_text

PARSERS = {sub.prog.split()[-1]: sub for sub in cli._subparsers(cli.build_parser())}


def _readme_command_lines() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", doc_text(), re.S)
    return [shlex.split(line, comments=True)[1:] for block in blocks for line in block.splitlines() if line.startswith("efla ")]


README_LINES = _readme_command_lines()
RUN_WITHOUT_INPUT = {"demo": "runs the CPU tour", "robustness": "trains on generated digits", "mad": "trains on generated tasks"}


def _options(argv: list[str]) -> dict[str, argparse.Action]:
    actions = {option: action for action in PARSERS[argv[0]]._actions for option in action.option_strings}
    return {token: actions[token] for token in argv if token in actions}


def _takes_an_input_path(argv: list[str]) -> bool:
    """Every README line names inputs under ../shared, runs/ or path/to/, which do not exist in a fresh directory."""
    return (
        any(not token.startswith("-") and "/" in token and argv[index - 1] != "--out" for index, token in enumerate(argv[1:], 1))
        or "--resume" in argv
    )


def _with_a_bad_value(argv: list[str]) -> tuple[list[str], str] | None:
    for option, action in _options(argv).items():
        if action.type in (int, float) or action.choices:
            index = argv.index(option) + 1
            return [*argv[:index], "many", *argv[index + 1 :]], option
    return None


def _case_id(argv: list[str]) -> str:
    return " ".join(argv)[:60]


def _run_mistake(argv: list[str], capsys, workdir: pathlib.Path) -> str:
    before = sorted(workdir.rglob("*"))
    try:
        status = cli.main(argv)
    except SystemExit as exited:
        status = exited.code
    captured = capsys.readouterr()
    assert status == 2, captured
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"efla {argv[0]}: .+ \(.+\)", lines[0]), lines[0]
    assert sorted(workdir.rglob("*")) == before
    if "--out" in argv:
        assert not (workdir / argv[argv.index("--out") + 1]).exists()
    return lines[0]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_shows_every_command_that_takes_input():
    shown = {argv[0] for argv in README_LINES}
    assert {"train", "eval", "generate", "serve", "convert", "compare", "robustness", "mad", "demo"} <= shown


@pytest.mark.parametrize("argv", README_LINES, ids=_case_id)
def test_a_missing_path_names_it(argv, capsys, workdir):
    if not _takes_an_input_path(argv):
        pytest.skip(
            f"efla {argv[0]}: this README line takes no input path; as written it "
            f"{RUN_WITHOUT_INPUT.get(argv[0], 'runs')}, too long for this test"
        )
    line = _run_mistake(argv, capsys, workdir)
    named = [token for token in argv[1:] if token.startswith("-") or "/" in token] + [
        a.metavar for a in PARSERS[argv[0]]._actions if isinstance(a.metavar, str)
    ]
    assert any(name in line for name in named), line


@pytest.mark.parametrize("argv", README_LINES, ids=_case_id)
def test_a_bad_option_value_names_the_option(argv, capsys, workdir):
    mistake = _with_a_bad_value(argv)
    if mistake is None:
        pytest.skip(f"efla {argv[0]}: this README line gives no option with a typed or chosen value")
    bad_argv, option = mistake
    assert option in _run_mistake(bad_argv, capsys, workdir)


@pytest.mark.parametrize("argv", README_LINES, ids=_case_id)
def test_an_unknown_option_is_named(argv, capsys, workdir):
    line = _run_mistake([*argv, "--bogus"], capsys, workdir)
    assert line.startswith(f"efla {argv[0]}: unrecognized arguments: --bogus"), line
