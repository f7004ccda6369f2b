"""A `efla train` run that fails before it has a checkpoint leaves no --out directory (or the empty one the
user made, still empty); a later failure leaves what a resume needs. Data errors name the file and the
option to change. Tiny sizes, one thread, CPU only."""

from __future__ import annotations

import os
import re
import pathlib

import pytest
import torch

from efla.cli import main
from efla.training.trainer import list_checkpoints, read_log, train

from .test_train_safety import _args, _cfg, _one_error_line, corpus, tokenizer_dir  # noqa: F401

_BPE = ["--vocab-size", "300", "--max-steps", "2", "--threads", "1", "--no-progress"]  # the tokenizer is trained


def _out_dirs(tmp_path: pathlib.Path, user_made: bool) -> pathlib.Path:
    out = tmp_path / "run"
    if user_made:
        out.mkdir()
    return out


def _left_as_it_was(out: pathlib.Path, user_made: bool) -> bool:
    return (out.is_dir() and os.listdir(out) == []) if user_made else not out.exists()


@pytest.mark.parametrize("user_made", [False, True])
def test_an_empty_data_file_is_named_and_leaves_nothing(tmp_path, capsys, user_made):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    out = _out_dirs(tmp_path, user_made)
    assert main(["train", "--data", str(empty), "--out", str(out), *_BPE]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"efla train: {empty}: empty, no text to train on (--data)"
    assert _left_as_it_was(out, user_made)


@pytest.mark.parametrize("user_made", [False, True])
def test_too_little_data_for_one_sequence_is_named_and_leaves_nothing(tmp_path, capsys, user_made):
    small = tmp_path / "small.txt"
    small.write_text("the cat sat on the mat.\n")
    out = _out_dirs(tmp_path, user_made)
    assert main(["train", "--data", str(small), "--out", str(out), *_BPE]) == 2  # trains a tokenizer, fills a cache
    line = _one_error_line(capsys.readouterr().err)
    assert re.fullmatch(
        rf"efla train: {re.escape(str(small))}: \d+ tokens do not fill one sequence of 256 tokens "
        r"\(--seq-len, or more --data\)",
        line,
    ), line
    assert _left_as_it_was(out, user_made)


def test_too_little_validation_data_names_val_data(corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    small = tmp_path / "val.txt"
    small.write_text("the cat sat.\n")
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out, "--val-data", str(small))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"efla train: {small}: ") and line.endswith("(--seq-len, or more --val-data)"), line
    assert not out.exists()


def test_holding_out_every_sequence_names_val_sequences(corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out, "--val-sequences", "100000")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--val-sequences 100000 would leave no training data" in line and "(--val-sequences" in line, line
    assert not out.exists()


def test_a_refused_resume_leaves_the_users_empty_directory_empty(corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "mine"
    out.mkdir()
    assert main(_args(corpus, tokenizer_dir, out, "--resume")) == 2
    assert "has no checkpoint to resume from" in _one_error_line(capsys.readouterr().err)
    assert os.listdir(out) == []


class _Crash(Exception):
    pass


def test_a_crash_before_the_first_checkpoint_leaves_nothing(corpus, tokenizer_dir, tmp_path):  # noqa: F811
    def crash_at_2(step, entry):
        if step == 2:
            raise _Crash

    out = tmp_path / "run"
    with pytest.raises(_Crash):
        train(_cfg(corpus, tokenizer_dir, out, save_every=0), on_step_end=crash_at_2)
    assert not out.exists()


def test_a_later_failure_leaves_what_resume_needs(corpus, tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    real_save = torch.save

    def disk_full_at_step_6(obj, path, *a, **k):
        if "step-0000006" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", disk_full_at_step_6)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        train(_cfg(corpus, tokenizer_dir, out))
    monkeypatch.setattr(torch, "save", real_save)
    assert [os.path.basename(p) for p in list_checkpoints(str(out))] == ["step-0000003"]
    assert os.listdir(out / "checkpoints") == ["step-0000003"]  # the half-written one is gone
    assert {"train_args.json", "log.jsonl", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert main(["train", "--out", str(out), "--resume", "--no-progress", "--threads", "1"]) == 0
    assert [e["step"] for e in read_log(str(out))] == list(range(1, 7))
