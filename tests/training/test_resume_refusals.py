"""`efla train --resume` continues the run on disk and nothing else: the README's table of options is
walked, each refused option is refused before any work with one line naming it and both values (the
run's files stay byte-identical), and each allowed one is accepted without being stored. Tiny sizes,
one thread, CPU only."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest

from efla.cli import main
from efla.training.config import RESUME_FIXED, RESUME_FREE
from efla.training.trainer import read_log, train
from efla.models import get_preset_config
from tests.doc_pages import doc_text

from .test_train_safety import _args, _cfg, _one_error_line, _tree, corpus, tokenizer_dir  # noqa: F401

REPO = pathlib.Path(__file__).resolve().parents[2]


class _Interrupted(Exception):
    pass


def _stop_after_3(step, entry):
    if step == 3:
        raise _Interrupted


@pytest.fixture(scope="module")
def finished_run(corpus, tokenizer_dir, tmp_path_factory) -> pathlib.Path:  # noqa: F811
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_args(corpus, tokenizer_dir, out)) == 0
    return out


@pytest.fixture(scope="module")
def interrupted_run(corpus, tokenizer_dir, tmp_path_factory) -> pathlib.Path:  # noqa: F811
    out = tmp_path_factory.mktemp("interrupted") / "run"
    with pytest.raises(_Interrupted):
        train(_cfg(corpus, tokenizer_dir, out), on_step_end=_stop_after_3)
    return out


def _readme_resume_table() -> dict[str, str]:
    """Option -> "refused" or "allowed", from the docs' table of options given with --resume."""
    lines = doc_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Option given with `--resume`"))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        options, verdict = (cell.strip() for cell in line.strip("|").split("|"))
        for option in re.findall(r"`(--[a-z0-9-]+)`", options):
            table[option] = verdict.split()[0]
    return table


def _config_file(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(get_preset_config("tiny-efla").to_dict()))
    return str(path)


def _refused_values(corpus, tmp_path) -> dict[str, list[str]]:  # noqa: F811
    """For each refused option, arguments that differ from the run's (stored: _args' settings, tiny-efla)."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(corpus / "doc0.txt", other / "doc0.txt")
    return {
        "--preset": ["--preset", "tiny-deltanet"],
        "--config": ["--config", _config_file(tmp_path)],
        "--seed": ["--seed", "1"],
        "--data": ["--data", str(other)],
        "--val-data": ["--val-data", str(other)],
        "--val-sequences": ["--val-sequences", "8"],
        "--text-field": ["--text-field", "body"],
        "--accept-invalid-utf8": ["--accept-invalid-utf8"],
        "--no-gutenberg-strip": ["--no-gutenberg-strip"],
        "--tokenizer": ["--tokenizer", "bpe"],
        "--vocab-size": ["--vocab-size", "500"],
        "--tokenizer-train-chars": ["--tokenizer-train-chars", "1000"],
        "--seq-len": ["--seq-len", "64"],
        "--batch-tokens": ["--batch-tokens", "256"],
        "--varlen": ["--varlen"],
        "--data-seed": ["--data-seed", "5"],
        "--max-steps": ["--max-steps", "10"],
        "--max-tokens": ["--max-tokens", "1280"],
        "--lr": ["--lr", "1e-3"],
        "--min-lr": ["--min-lr", "1e-4"],
        "--warmup-steps": ["--warmup-steps", "3"],
        "--weight-decay": ["--weight-decay", "0.3"],
        "--grad-clip": ["--grad-clip", "0.5"],
    }


# the schedule options keep their own message: "... other settings (--max-steps 6 -> 10) ... (--resume)"
_SCHEDULE_NAMED_AS = {"--max-tokens": "--max-steps 6 -> 10"}


def _allowed_args(tmp_path) -> dict[str, list[str]]:
    return {
        "--extend-at-min-lr": ["--extend-at-min-lr"],
        "--on-nonfinite": ["--on-nonfinite", "skip"],
        "--save-every": ["--save-every", "2"],
        "--time-limit": ["--time-limit", "3600"],
        "--keep-checkpoints": ["--keep-checkpoints", "5"],
        "--val-every": ["--val-every", "2"],
        "--log-every": ["--log-every", "2"],
        "--threads": ["--threads", "2"],
        "--no-progress": ["--no-progress"],
        "--cache-dir": ["--cache-dir", str(tmp_path / "cache")],
        "--device": ["--device", "cpu"],
        "--precision": ["--precision", "fp32"],
        "--micro-batch-size": ["--micro-batch-size", "2"],
        "--grad-checkpointing": ["--grad-checkpointing"],
    }


_NEEDS_TORCHRUN = {"--fsdp", "--context-parallel"}  # accepted by the option check; checked there below


def _resume(out, *extra) -> int:
    return main(["train", "--out", str(out), "--resume", "--threads", "1", "--no-progress", *extra])


def test_the_table_names_every_option_the_code_knows():
    table = _readme_resume_table()
    fixed = set(RESUME_FIXED.values()) | {
        "--max-steps",
        "--max-tokens",
        "--lr",
        "--min-lr",
        "--warmup-steps",
        "--weight-decay",
        "--grad-clip",
    }
    assert {o for o, verdict in table.items() if verdict == "refused"} == fixed
    assert {o for o, verdict in table.items() if verdict == "allowed"} == set(RESUME_FREE.values()) | {"--extend-at-min-lr"}


def test_each_refused_option_in_the_readme_table_is_refused_and_changes_nothing(finished_run, corpus, tmp_path, capsys):  # noqa: F811
    values = _refused_values(corpus, tmp_path)
    refused = [o for o, verdict in _readme_resume_table().items() if verdict == "refused"]
    assert refused and set(refused) <= set(values)
    before = _tree(finished_run)
    for option in refused:
        assert _resume(finished_run, *values[option]) == 2, option
        line = _one_error_line(capsys.readouterr().err)
        if option in RESUME_FIXED.values():
            assert line.endswith(f"--resume continues the run on disk ({option})"), line
            assert f"{option} was " in line and ", got " in line, line
        else:
            assert _SCHEDULE_NAMED_AS.get(option, option) in line and line.endswith("(--resume)"), line
        assert _tree(finished_run) == before, option  # config.json, weights, train_args.json, log: untouched


def test_the_refusal_names_both_values(finished_run, corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    assert _resume(finished_run, "--preset", "tiny-deltanet") == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "efla train: --preset was tiny-efla in this run, got tiny-deltanet; --resume continues the run on disk (--preset)"
    )
    assert _resume(finished_run, "--tokenizer", "bpe") == 2
    assert f"--tokenizer was {tokenizer_dir} in this run, got bpe" in _one_error_line(capsys.readouterr().err)
    assert _resume(finished_run, "--val-sequences", "8") == 2
    assert "--val-sequences was 4 in this run, got 8" in _one_error_line(capsys.readouterr().err)


def test_an_interrupted_run_refuses_another_model_and_keeps_its_files(interrupted_run, capsys):
    before = _tree(interrupted_run)
    for extra in (["--preset", "tiny-deltanet"], ["--data-seed", "5"], ["--preset", "340m-efla"]):
        assert _resume(interrupted_run, *extra) == 2
        assert "--resume continues the run on disk" in _one_error_line(capsys.readouterr().err)
    assert _tree(interrupted_run) == before
    assert [e["step"] for e in read_log(str(interrupted_run))] == [1, 2, 3]


def test_the_python_api_refuses_a_changed_setting_too(interrupted_run, corpus, tokenizer_dir):  # noqa: F811
    from efla.errors import UsageError

    before = _tree(interrupted_run)
    with pytest.raises(UsageError, match=r"--data-seed was 0 in this run, got 5"):
        train(_cfg(corpus, tokenizer_dir, interrupted_run, resume=True, data_seed=5))
    assert _tree(interrupted_run) == before


def test_allowed_options_are_accepted_and_not_stored(interrupted_run, tmp_path):
    allowed = [o for o, verdict in _readme_resume_table().items() if verdict == "allowed"]
    values = _allowed_args(tmp_path)
    assert set(allowed) == set(values) | _NEEDS_TORCHRUN
    out = tmp_path / "run"
    shutil.copytree(interrupted_run, out)
    stored = (out / "train_args.json").read_bytes()
    extra = [arg for option in allowed if option in values for arg in values[option]]
    assert _resume(out, *extra) == 0
    assert [e["step"] for e in read_log(str(out))] == [1, 2, 3, 4, 6]  # --log-every 2 from step 4 on
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 6
    assert (out / "train_args.json").read_bytes() == stored  # --threads 2, --cache-dir, ... were not recorded


@pytest.mark.parametrize("option, value", [("fsdp", True), ("context_parallel", 2)])
def test_parallel_layouts_pass_the_resume_check(finished_run, option, value):
    from efla.training.config import check_resume_unchanged

    stored = json.loads((finished_run / "train_args.json").read_text())
    check_resume_unchanged(stored, dict(stored, **{option: value}))  # how the same steps run: not refused
