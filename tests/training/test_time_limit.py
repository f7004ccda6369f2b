"""`efla train --time-limit`: the run stops after the step that passes the limit, with a checkpoint
there, and resuming it gives the uninterrupted run's losses. Tiny sizes, one thread, CPU only."""

from __future__ import annotations

import json

from efla.cli import main
from efla.training.trainer import list_checkpoints, read_log, train
from efla_lab.lm.report import stored_run

from .test_train_safety import _args, _cfg, corpus, tokenizer_dir  # noqa: F401

AT_ONCE = "0.000001"  # seconds: passed by the end of the first step


def test_a_run_stopped_by_the_time_limit_resumes_to_the_uninterrupted_losses(corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    whole = train(_cfg(corpus, tokenizer_dir, tmp_path / "whole"))
    out = tmp_path / "stopped"
    assert main(_args(corpus, tokenizer_dir, out, "--time-limit", AT_ONCE)) == 0
    assert "stopped at step 1 of 6 (--time-limit), continue with --resume" in capsys.readouterr().err
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["steps"], summary["max_steps"], summary["stopped_early"]) == (1, 6, True)
    assert [c.rsplit("-", 1)[-1] for c in map(str, list_checkpoints(str(out)))] == ["0000001"]
    assert stored_run(str(out)) is None  # not a finished run for the reports

    resumed = train(_cfg(corpus, tokenizer_dir, out, resume=True))
    assert resumed["stopped_early"] is False and resumed["steps"] == 6
    assert [e["loss"] for e in read_log(str(out))] == whole["losses"]
    assert stored_run(str(out))["train_summary"]["steps"] == 6


def test_a_negative_time_limit_is_refused(corpus, tokenizer_dir, tmp_path, capsys):  # noqa: F811
    assert main(_args(corpus, tokenizer_dir, tmp_path / "run", "--time-limit", "-1")) == 2
    assert capsys.readouterr().err.strip().endswith("(--time-limit)")
    assert not (tmp_path / "run").exists()
