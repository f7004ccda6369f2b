"""One command-line language: every subcommand is described, every option explained, and a mistake on the
command line is one line that names the subcommand, exit status 2, before anything else is checked."""

from __future__ import annotations

import argparse
import importlib.metadata

import pytest

import efla
from efla import cli
from efla.cli import build_parser, main

SUBCOMMANDS = {sub.prog.split()[-1]: sub for sub in cli._subparsers(build_parser())}
WITH_REQUIRED_ARGUMENTS = sorted(
    name for name, sub in SUBCOMMANDS.items() if any(a.required and a.nargs != argparse.ZERO_OR_MORE for a in sub._actions)
)


def _visible_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


def _mistake(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_walk_sees_every_command():
    assert {
        "demo",
        "robustness",
        "lr-sweep",
        "convert",
        "eval",
        "compare",
        "generate",
        "serve",
        "mad",
        "train",
        "lm-report",
    } <= set(SUBCOMMANDS)
    assert {"train", "lm-report", "eval", "convert"} <= set(WITH_REQUIRED_ARGUMENTS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_is_described_and_every_option_explained(name):
    parser = SUBCOMMANDS[name]
    assert parser.description and len(parser.description.split()) >= 5, name
    unexplained = [a.option_strings or [a.dest] for a in _visible_options(parser) if not (a.help or "").strip()]
    assert unexplained == [], f"efla {name}: options without help: {unexplained}"


def test_lr_sweep_shows_one_name_for_its_learning_rates():
    lr_sweep = {s for a in _visible_options(SUBCOMMANDS["lr-sweep"]) for s in a.option_strings}
    assert "--lrs" in lr_sweep and "--lr" not in lr_sweep
    assert "--lr" in {s for a in SUBCOMMANDS["robustness"]._actions for s in a.option_strings}


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"efla {importlib.metadata.version('efla')}\n"


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.installed_version() == efla.__version__


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_an_unknown_option_names_the_subcommand_before_missing_arguments(name, capsys):
    line = _mistake([name, "--bogus"], capsys)
    assert line.startswith(f"efla {name}: unrecognized arguments: --bogus"), line


def test_an_unknown_option_after_valid_ones_is_named_too(capsys):
    line = _mistake(["train", "--out", "somewhere", "--max-steps", "3", "--bogus", "extra"], capsys)
    assert line.startswith("efla train: unrecognized arguments: --bogus extra"), line


@pytest.mark.parametrize("name", WITH_REQUIRED_ARGUMENTS)
def test_a_missing_argument_names_the_subcommand(name, capsys):
    line = _mistake([name], capsys)
    assert line.startswith(f"efla {name}: the following arguments are required: "), line
    assert line.endswith(f"(see efla {name} --help)"), line


def test_a_missing_subcommand_is_efla_s_own_mistake(capsys):
    assert _mistake([], capsys).startswith("efla: the following arguments are required: command")


@pytest.mark.parametrize("name", WITH_REQUIRED_ARGUMENTS)
def test_an_unknown_option_before_the_subcommand_is_efla_s_own_mistake(name, capsys):
    line = _mistake(["--bogus", name], capsys)
    assert line == "efla: unrecognized arguments: --bogus (see efla --help)", line


def test_an_abbreviated_efla_option_before_the_subcommand_still_works(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--vers", "train"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("efla ")
