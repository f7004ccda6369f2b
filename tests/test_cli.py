"""The command line: `efla demo` runs and writes its results; every command reports a mistake in one
line (exit status 2), a failure in one line (exit status 1), and the traceback only when asked."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import re
import sys
import time

import numpy as np
import pytest

from efla.cli import main
from tests.doc_pages import doc_text


def test_demo_quick_writes_results(tmp_path, capsys):
    assert main(["demo", "--quick", "--epochs", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "demo.json").read_text())
    rows = data["one_step"]
    assert [r["euler_expands"] for r in rows] == [r["beta_lambda"] > 2 for r in rows]
    small = [r for r in rows if r["beta_lambda"] <= 1e-2]
    # one-step difference ~ (beta lambda)^2: a 10x smaller step gives ~100x smaller difference
    ratio = small[0]["one_step_rel_diff"] / small[-1]["one_step_rel_diff"]  # x = 1e-3 vs 1e-2
    assert 0.009 < ratio < 0.011
    assert all(t["chunk_fwd_bwd_ms"] > 0 and t["recurrent_fwd_bwd_ms"] > 0 for t in data["cpu_timings"])
    assert "One step" in capsys.readouterr().out
    rb = data["robustness"]["rules"]
    assert set(rb) == {"exact", "euler"}
    for r in rb.values():
        assert 0 <= r["eval"]["clean"] <= 1 and len(r["eval"]["scale"]["accuracy"]) == 5
    for name in ("one_step.png", "robustness.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 200, name
    assert 0 <= data["mad"]["exact"] <= 1 and 0 <= data["mad"]["euler"] <= 1
    report = (tmp_path / "report.md").read_text()
    assert "MAD in-context recall" in report
    assert "![one step](one_step.png)" in report and "| metric | EFLA | DeltaNet |" in report


# -- every command: one line, exit 2 for usage errors and 1 for failures, --debug for the traceback ---

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _one_error_line(err: str, command: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"efla {command}: ") and "Traceback" not in err, err
    return lines[0]


def _fake_model_dir(path: pathlib.Path) -> pathlib.Path:
    """Passes the up-front model-directory check (never loaded: the tests fail before that)."""
    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")
    return path


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["eval", "--model", "no/such/model-dir"], "no such directory: no/such/model-dir (--model)"),
        (["compare", "no-such-dir", "--out", "x"], "no such directory: no-such-dir (MODELS)"),
        (["convert", "no-such-src", "dst"], "no such directory: no-such-src (SRC)"),
        (["robustness", "--epochs", "0"], "expected a value >= 1, got 0 (--epochs)"),
        (["lr-sweep", "--lrs", "1e-3", "-1"], "expected a value > 0, got -1 (--lrs)"),
        (["lr-sweep", "--data-dir", "no-such-mnist"], "no such directory: no-such-mnist (--data-dir)"),
        (["mad", "--tasks", "no-such-task"], "unknown task 'no-such-task'"),
        (["mad", "--num-heads", "0"], "(--num-heads)"),
        (["mad", "--device", "cpu", "--cuda-graph"], "CUDA graphs need a CUDA device, got 'cpu' (--cuda-graph)"),
        (["mad", "--together", "0"], "expected a value >= 1, got 0 (--together)"),
        (["mad", "--seed", "-1"], "expected a value >= 0, got -1 (--seed)"),
        (["mad", "--together", "2", "--time-limit", "60"], "needs runs trained one at a time (--together)"),
        (
            ["mad", "--device", "cuda", "--together", "33"],
            "at most 32 runs side by side on a GPU, one CUDA stream each, got 33 (--together)",
        ),
        (["demo", "--epochs", "0"], "expected a value >= 1, got 0 (--epochs)"),
        (["train", "--out", "x", "--data", "no-such-corpus"], "no-such-corpus: no such file or directory"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert expected in _one_error_line(capsys.readouterr().err, argv[0])
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--data", "corpus"], "the following arguments are required: --out"),
        (["eval", "--model", "m", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["mad", "--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    ],
)
def test_command_line_mistakes_are_one_line_with_status_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    line = _one_error_line(capsys.readouterr().err, argv[0])
    assert expected in line and line.endswith(f"(see efla {argv[0]} --help)")


def test_eval_names_the_file_and_line_at_fault(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "notes.txt").write_text("hello")
    assert main(["eval", "--model", "not-a-model", "--wikitext", "none", "--lambada", "none"]) == 2
    assert "not-a-model is not a model directory: no config.json (--model)" in _one_error_line(capsys.readouterr().err, "eval")

    model = _fake_model_dir(tmp_path / "model")
    (tmp_path / "empty.raw").write_text("\n\n")
    assert main(["eval", "--model", str(model), "--wikitext", "empty.raw", "--lambada", "none"]) == 2
    assert "empty.raw: the file is empty (--wikitext)" in _one_error_line(capsys.readouterr().err, "eval")

    lines = [json.dumps({"text": f"passage number {i} ends here"}) for i in range(5)] + ["{'text': 'single quotes'}"]
    (tmp_path / "lambada.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["eval", "--model", str(model), "--wikitext", "none", "--lambada", "lambada.jsonl"]) == 2
    line = _one_error_line(capsys.readouterr().err, "eval")
    assert "lambada.jsonl:6: not a JSON line" in line and line.endswith("(--lambada)")
    assert sorted(os.listdir(tmp_path)) == ["empty.raw", "lambada.jsonl", "model", "not-a-model"]


def _write_idx(path: pathlib.Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_truncated_mnist_gz_is_named(tmp_path, capsys):
    rng = np.random.default_rng(0)
    mnist = tmp_path / "mnist"
    mnist.mkdir()
    for stem, n in (("train", 20), ("t10k", 10)):
        _write_idx(mnist / f"{stem}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(mnist / f"{stem}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    broken = mnist / "train-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:-200])
    out = tmp_path / "out"
    assert main(["robustness", "--data-dir", str(mnist), "--out", str(out), "--device", "cpu"]) == 2
    line = _one_error_line(capsys.readouterr().err, "robustness")
    assert f"{broken}: a truncated or damaged gzip file" in line and line.endswith("(--data-dir)")
    assert not out.exists()


def test_failures_are_one_line_with_status_1_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    import efla_lab.demo as demo

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "demo.json"))

    monkeypatch.setattr(demo, "run_demo", disk_full)
    assert main(["demo", "--out", str(tmp_path / "d")]) == 1
    assert "No space left on device" in _one_error_line(capsys.readouterr().err, "demo")

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(demo, "run_demo", bug)
    assert main(["demo", "--out", str(tmp_path / "d")]) == 1
    assert "KeyError" in _one_error_line(capsys.readouterr().err, "demo")
    with pytest.raises(KeyError):
        main(["demo", "--out", str(tmp_path / "d"), "--debug"])
    monkeypatch.setenv("EFLA_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["demo", "--out", str(tmp_path / "d")])


# -- the demo: one stated time, outputs part by part, time left, threads from the load --------------


def test_demo_threads_follow_the_load():
    from efla_lab.demo import threads_for_load

    assert threads_for_load(2, 0.05) == 2
    assert threads_for_load(2, 1.2) == 1
    assert threads_for_load(2, 12.0) == 1
    assert threads_for_load(16, 3.6) == 12


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="samples /proc/stat (Linux)")
def test_current_load_sees_a_busy_core_at_once():
    import subprocess

    from efla_lab.demo import current_load

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert current_load(0.5) > 0.6  # the spinner's core, measured now (the load average lags a minute)
    finally:
        spinner.kill()
        spinner.wait()


def test_current_load_falls_back_to_the_load_average(monkeypatch):
    import efla_lab.demo as demo

    monkeypatch.setattr(demo, "_cpu_times", lambda: None)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.5, 1.0, 0.5))
    assert demo.current_load() == 1.5


def test_demo_estimates_the_time_left_from_finished_parts():
    import efla_lab.demo as demo
    from efla_lab.demo import PART_SHARE, projected_rest

    assert sum(PART_SHARE.values()) == pytest.approx(1.0)
    # a pure function of the parts finished and an elapsed span given here: no clock is read
    done = {"one_step": [], "robustness": {}}
    share = PART_SHARE["one_step"] + PART_SHARE["robustness"]
    measured = demo.MEASURED_SECONDS
    assert projected_rest(done, 46.0) == pytest.approx(46.0 * (1 - share) / share)
    assert projected_rest(dict(done, mad={}, cpu_timings=[]), 80.0) == pytest.approx(0.0, abs=1e-9)
    assert projected_rest({"one_step": []}, 0.2) == pytest.approx(measured * (1 - PART_SHARE["one_step"]))


def test_demo_states_one_measured_time_in_readme_help_and_banner(tmp_path, capsys, monkeypatch):
    import efla_lab.demo as demo
    from efla.cli import build_parser

    stated = f"about {demo.MEASURED_SECONDS} s on an idle 2-core CPU"
    assert stated in README.read_text()  # the Quickstart's own words
    times = set(re.findall(r"(\d+)(?: |-)(?:s\b|seconds?\b|minutes?\b)", _readme_demo_lines()))
    assert times == {str(demo.MEASURED_SECONDS)}, times
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "demo" in a.choices)
    assert stated in next(c.help for c in sub._choices_actions if c.dest == "demo")
    assert f"about {demo.MEASURED_SECONDS} s on an idle 2-core CPU" in " ".join(sub.choices["demo"].format_help().split())

    monkeypatch.setattr(demo, "run_mad_demo_task", _interrupt)
    assert main(["demo", "--epochs", "1", "--out", str(tmp_path)]) == 130
    out, err = capsys.readouterr()
    assert stated in " ".join(out.split())
    assert "interrupted" in err


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _readme_demo_lines() -> str:
    """The Quickstart section and every other README line that mentions the demo."""
    quickstart = README.read_text().split("## Quickstart")[1].split("\n## ")[0]
    return quickstart + "\n".join(ln for ln in doc_text().splitlines() if "demo" in ln.lower())


def test_interrupted_demo_keeps_the_parts_it_finished(tmp_path, capsys, monkeypatch):
    import efla_lab.demo as demo

    monkeypatch.setattr(demo, "run_mad_demo_task", _interrupt)
    assert main(["demo", "--epochs", "1", "--threads", "1", "--out", str(tmp_path)]) == 130
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert set(saved) >= {"one_step", "robustness"} and "mad" not in saved and "cpu_timings" not in saved
    report = (tmp_path / "report.md").read_text()
    assert "![one step](one_step.png)" in report and "digits: clean test accuracy" in report
    assert "Not finished yet: (c) MAD recall, (d) CPU timings" in report
    assert (tmp_path / "one_step.png").stat().st_size > 200 and (tmp_path / "robustness.png").stat().st_size > 200
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"\(b\) digits done at \d+ s; about \d+ s left", out), out


def test_error_classes_choose_the_exit_status():
    """By type, not by name: a damaged checkpoint is a wrong input (2), like a usage error; a failure
    that began the work is 1; anything else is 1 with a hint at the traceback."""
    from efla.cli import exit_status_and_message
    from efla.errors import CheckpointError, NonFiniteValues, RunFailure, UsageError

    assert exit_status_and_message(CheckpointError("ckpt: damaged"))[0] == 2
    assert exit_status_and_message(UsageError("x (--y)")) == (2, "x (--y)")
    assert exit_status_and_message(NonFiniteValues("q: contains 1 non-finite value(s)"))[0] == 2
    assert exit_status_and_message(RunFailure("disk full"))[0] == 1

    same_name_other_class = type("CheckpointError", (Exception,), {})
    status, message = exit_status_and_message(same_name_other_class("?"))
    assert status == 1 and "unexpected error" in message


def test_a_run_warning_is_one_line_from_the_command_and_a_warning_from_the_library(capsys):
    """The training code warns (``RunWarning``); the command line prints ``efla <command>: warning: ...``
    and leaves other warnings to Python."""
    import warnings

    from efla.cli import _one_line_warnings
    from efla.errors import RunWarning

    others = []
    show = _one_line_warnings("train", lambda *a: others.append(a[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        warnings.warn("took over the lock", RunWarning, stacklevel=1)
        warnings.warn("something else", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().err == "efla train: warning: took over the lock\n"
    assert [str(w) for w in others] == ["something else"]
    with pytest.warns(RunWarning, match="lock"):
        warnings.warn("took over the lock", RunWarning, stacklevel=1)


def test_a_mistyped_efla_debug_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("EFLA_DEBUG", "2")
    assert main(["convert", "no/such/dir", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("efla convert: EFLA_DEBUG='2'") and err[0].endswith("(EFLA_DEBUG)")


def test_an_installed_command_that_cannot_load_leaves_the_others(monkeypatch, capsys):
    import importlib.metadata

    import efla.cli

    broken = importlib.metadata.EntryPoint(name="broken", value="no_such_module_here:add_parser", group="efla.commands")
    installed = list(importlib.metadata.entry_points(group="efla.commands"))
    monkeypatch.setattr(efla.cli.importlib.metadata, "entry_points", lambda group: [broken, *installed])
    parser = efla.cli.build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    assert {"train", "demo", "mad"} <= commands and "broken" not in commands
    err = capsys.readouterr().err
    assert "efla: the command 'broken' (no_such_module_here:add_parser) cannot load" in err
