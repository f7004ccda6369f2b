"""A new user types the README's command lines with mistakes: a missing path, a bad option value, an unknown
option. Each is one line ``efla <command>: <what> (<option or file>)`` on stderr, exit status 2, and leaves
the working directory as it was (no --out made)."""

from __future__ import annotations

import argparse
import json
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
    out = workdir / argv[argv.index("--out") + 1] if "--out" in argv else None
    out_existed = out is not None and out.exists()
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
    if out is not None and not out_existed:
        assert not out.exists()
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


# -- every file a command reads is checked in full, a command given nothing to do says so, and a value the
#    chosen mode would ignore is refused: each before any work, naming the key or option and the file

FLA_CONFIG = pathlib.Path(__file__).parent / "fixtures" / "fla_delta_net" / "config.json"


def _efla_config(**changes) -> str:
    from efla.models import EFLAConfig

    fields = json.loads(EFLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2).to_json_string())
    return json.dumps({**fields, **changes}, indent=2)


def _model_dir(config: str) -> dict[str, str]:
    """What the model-directory checks look at (the mistakes below are all found before anything loads)."""
    return {"config.json": config, "model.safetensors": "", "tokenizer.json": "{}"}


def _misspelt(fields: dict, key: str, misspelt: str) -> str:
    return json.dumps({(misspelt if k == key else k): v for k, v in fields.items()}, indent=2)


def _inputs() -> dict[str, dict[str, str] | str]:
    """The files and directories of the cases, by name: a dict is a directory."""
    return {
        "corpus": {"a.txt": "Some training text.\n" * 50},
        "empty": {},
        "mnist": {},
        "model": _model_dir(_efla_config()),
        "model-typo": _model_dir(_efla_config(num_hiden_layers=3)),
        "model.json": json.dumps({"hidden_size": 32, "num_heads": 2, "vocab_sise": 64}, indent=2),
        "recipe.json": json.dumps({"hidden_size": 32, "learning_rat": 1e-3}, indent=2),
        "run": {
            "train_args.json": json.dumps({"data": ["corpus"], "max_steps": 2, "learnig_rate": 1e-3}, indent=2),
            "checkpoints": {"step-0000002": {}},
        },
        "fla": {"config.json": _misspelt(json.loads(FLA_CONFIG.read_text()), "num_hidden_layers", "num_hiden_layers")},
        "blank.txt": "\n\n",
    }


def _write(base: pathlib.Path, inputs: dict) -> None:
    for name, content in inputs.items():
        if isinstance(content, dict):
            (base / name).mkdir()
            _write(base / name, content)
        else:
            (base / name).write_text(content)


# (argv, the key or option the line names, the file it names or None)
MISSPELT_KEYS = [
    (["train", "--config", "model.json", "--data", "corpus", "--out", "out"], "vocab_sise", "model.json"),
    (["train", "--config", "recipe.json", "--data", "corpus", "--out", "out"], "learning_rat", "recipe.json"),
    (["train", "--out", "run", "--resume"], "learnig_rate", "run/train_args.json"),
    (["generate", "model-typo", "Once"], "num_hiden_layers", "model-typo/config.json"),
    (["serve", "model-typo"], "num_hiden_layers", "model-typo/config.json"),
    (["eval", "--model", "model-typo"], "num_hiden_layers", "model-typo/config.json"),
    (["compare", "model-typo", "--out", "out"], "num_hiden_layers", "model-typo/config.json"),
    (["convert", "fla", "out"], "num_hiden_layers", "fla/config.json"),
]
NOTHING_TO_DO = [
    (["train", "--out", "out"], "--data", None),
    (["train", "--data", "empty", "--out", "out"], "--data", "empty"),
    (["train", "--data", "corpus", "--out", "out", "--max-steps", "2", "--resume"], "--resume", "out"),
    (["eval", "--model", "model", "--wikitext", "none", "--lambada", "none"], "--wikitext", None),
    (["generate", "model"], "PROMPT", None),
    (["generate", "model", "--prompts-file", "blank.txt"], "--prompts-file", "blank.txt"),
    (["compare", "--out", "out"], "MODELS", None),
    (["convert", "empty", "out"], "SRC", "empty"),
    (["mad", "--report-only", "--out", "out"], "--report-only", "out"),
    (["lm-report", "--runs", "empty", "--out", "out"], "--runs", None),
]
IGNORED_VALUES = [
    (["train", "--data", "corpus", "--out", "out", "--max-steps", "2", "--extend-at-min-lr"], "--extend-at-min-lr", None),
    (["train", "--data", "corpus", "--out", "out", "--max-steps", "2", "--max-tokens", "512"], "--max-tokens", None),
    (
        ["train", "--data", "corpus", "--out", "out", "--max-steps", "2", "--tokenizer", "gpt2", "--vocab-size", "512"],
        "--vocab-size",
        None,
    ),
    (["generate", "model", "Once", "--top-k", "5"], "--top-k", None),
    (["generate", "model", "Once", "--top-p", "0.9"], "--top-p", None),
    (["generate", "model", "Once", "--seed", "1"], "--seed", None),
    (["serve", "model", "--prefix-cache-mb", "0", "--prefix-block", "8"], "--prefix-block", None),
    (
        ["eval", "--model", "model", "--wikitext", "none", "--lambada", "none", "--harness", "hellaswag", "--stride", "8"],
        "--stride",
        None,
    ),
    (["eval", "--model", "model", "--wikitext", "wiki.raw", "--lambada", "none", "--limit", "5"], "--limit", None),
    (["eval", "--model", "model", "--wikitext", "wiki.raw", "--num-fewshot", "2"], "--num-fewshot", None),
    (["compare", "model", "--out", "out", "--wikitext", "wiki.raw", "--harness-limit", "3"], "--harness-limit", None),
    (["mad", "--report-only", "--out", "out", "--together", "2"], "--together", None),
    (["robustness", "--dataset", "digits", "--data-dir", "mnist", "--out", "out"], "--data-dir", None),
    (["lr-sweep", "--dataset", "digits", "--data-dir", "mnist", "--out", "out"], "--data-dir", None),
]


@pytest.fixture
def inputs(workdir) -> pathlib.Path:
    _write(workdir, _inputs())
    return workdir


def _line_of(path: pathlib.Path, key: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if f'"{key}"' in line)


@pytest.mark.parametrize("argv, key, file", MISSPELT_KEYS, ids=lambda case: _case_id(case) if isinstance(case, list) else "")
def test_a_misspelt_key_in_a_file_is_named_with_its_file_and_line(argv, key, file, capsys, inputs):
    line = _run_mistake(argv, capsys, inputs)
    assert f"{file}:{_line_of(inputs / file, key)}: unknown key {key!r}" in line, line


def test_every_command_that_reads_a_config_file_is_walked():
    assert {argv[0] for argv, _, _ in MISSPELT_KEYS} == {"train", "generate", "serve", "eval", "compare", "convert"}


@pytest.mark.parametrize("argv, option, file", NOTHING_TO_DO, ids=lambda case: _case_id(case) if isinstance(case, list) else "")
def test_a_command_given_nothing_to_do_says_so(argv, option, file, capsys, inputs):
    line = _run_mistake(argv, capsys, inputs)
    assert line.endswith(")") and option in line.rsplit("(", 1)[1], line
    assert file is None or file in line, line


@pytest.mark.parametrize("argv, option, file", IGNORED_VALUES, ids=lambda case: _case_id(case) if isinstance(case, list) else "")
def test_a_value_the_command_would_ignore_is_refused(argv, option, file, capsys, inputs):
    line = _run_mistake(argv, capsys, inputs)
    assert line.endswith(f"{option} has no effect " + line.split(" has no effect ", 1)[1]) and line.endswith(f"({option})"), line


def test_the_same_options_are_accepted_where_they_take_effect(capsys, inputs):
    """The refusals above depend on the mode: with sampling, --top-k passes the checks and reaches the loading
    of the (here fake) weights, a failure of the run (1), not of the command line."""
    status = cli.main(["generate", "model", "Once", "--top-k", "5", "--temperature", "0.7"])
    assert status == 1, capsys.readouterr().err


def test_a_saved_config_holds_only_keys_the_check_knows(tmp_path):
    from efla.models import EFLAConfig, get_preset_config
    from efla.models.configuration_efla import config_file_keys
    from efla.models.convert import fla_config_to_efla

    converted = fla_config_to_efla(json.loads(FLA_CONFIG.read_text()), "exact")
    hybrid = EFLAConfig(attn={"layers": [0], "num_heads": 2}, num_hidden_layers=2)
    for config in (get_preset_config("tiny-gated-efla"), hybrid, converted):
        config.save_pretrained(tmp_path)
        assert set(json.loads((tmp_path / "config.json").read_text())) <= config_file_keys()


def test_an_unknown_lm_eval_task_is_named_before_the_model_loads(capsys, inputs, monkeypatch):
    from types import SimpleNamespace

    from efla import evaluation

    monkeypatch.setattr(evaluation, "task_manager", lambda include_path=None: SimpleNamespace(all_tasks=["hellaswag", "piqa"]))
    argv = ["eval", "--model", "model", "--wikitext", "none", "--lambada", "none", "--harness", "piqa,hellaswg"]
    assert "lm-eval has no task 'hellaswg' (--harness)" in _run_mistake(argv, capsys, inputs)


@pytest.mark.parametrize("text", ['{"modle": {"name": "a"}}', "[1, 2]", '{"records": [{"model": {}},'])
def test_compare_reads_every_recorded_evaluation_before_evaluating(text, capsys, inputs):
    (inputs / "old.json").write_text(text)
    line = _run_mistake(["compare", "model-typo", "old.json", "--out", "out"], capsys, inputs)
    assert line.startswith("efla compare: old.json: not ") and line.endswith("(MODELS)"), line
