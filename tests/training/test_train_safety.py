"""`efla train` keeps users' data safe: it writes only into its own run directories, locks them, refuses
binary or undecodable text, checks every option before work starts, resumes only what it can resume
exactly, and never unpickles a checkpoint. Tiny sizes, one thread, CPU only."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from efla.cli import main
from efla.data.text import check_text_file, read_documents
from efla.data.tokenizer import train_bpe_tokenizer
from efla.errors import UsageError
from efla.training.trainer import TrainConfig, list_checkpoints, read_log, scheduled_lr, train

REPO = pathlib.Path(__file__).resolve().parents[2]
_WORDS = "the cat dog bird sat ran on under a mat tree red small big and then saw".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(2):
        words = [_WORDS[j] for j in rng.integers(len(_WORDS), size=1500)]
        (root / f"doc{i}.txt").write_text(" ".join(words) + ".\n")
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(read_documents([str(corpus)]), vocab_size=300, save_dir=str(d))
    return str(d)


def _args(corpus, tokenizer_dir, out, *extra) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--tokenizer",
        tokenizer_dir,
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--batch-tokens",
        "128",
        "--max-steps",
        "6",
        "--save-every",
        "3",
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--val-sequences",
        "4",
        "--threads",
        "1",
        "--no-progress",
        *extra,
    ]


def _cfg(corpus, tokenizer_dir, out, **kw) -> TrainConfig:
    base = dict(
        data=[str(corpus)],
        out=str(out),
        tokenizer=tokenizer_dir,
        seq_len=32,
        batch_tokens=128,
        max_steps=6,
        save_every=3,
        lr=3e-3,
        min_lr=3e-4,
        val_sequences=4,
        threads=1,
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _one_error_line(err: str, command: str = "train") -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"efla {command}: "), err
    assert "Traceback" not in err
    return lines[0]


def _tree(path: pathlib.Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- 1. the output directory ----------------------------------------------------------------------


def test_out_holding_a_users_files_is_refused_before_writing(corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's weights")
    (out / "config.json").write_text("{ not json")
    before = _tree(out)
    assert main(_args(corpus, tokenizer_dir, out)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(out) in line and "--overwrite" in line and line.endswith("(--out)")
    assert _tree(out) == before  # nothing written, nothing replaced

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(_args(corpus, tokenizer_dir, a_file)) == 2
    assert "is not a directory" in _one_error_line(capsys.readouterr().err)


def test_overwrite_writes_into_a_foreign_directory(corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(_args(corpus, tokenizer_dir, out, "--overwrite")) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "keep me"


_HOLD_LOCK = """
import sys, time
from efla.training.run_dir import claim_run_dir
claim_run_dir(sys.argv[1], command="efla train (the first run)")
print("locked", flush=True)
time.sleep(120)
"""


def test_second_run_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(_args(corpus, tokenizer_dir, out)) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"in use by pid {holder.pid}" in line and "the first run" in line
        assert sorted(os.listdir(out)) == [".efla-run.lock"]  # the refused run wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert main(_args(corpus, tokenizer_dir, out)) == 0
    err = capsys.readouterr().err
    assert f"took over the lock of a run that is no longer running (pid {holder.pid})" in err
    assert [e["step"] for e in read_log(str(out))] == list(range(1, 7))


def test_the_lock_is_held_while_training_and_released_after(corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    seen = []

    def second_run(step, entry):
        if step == 2:
            with pytest.raises(UsageError, match=f"in use by pid {os.getpid()}"):
                train(_cfg(corpus, tokenizer_dir, out, resume=True))
            seen.append(step)

    train(_cfg(corpus, tokenizer_dir, out), on_step_end=second_run)
    assert seen == [2]
    assert (out / ".efla-run.lock").read_text() == ""  # released: no holder recorded
    train(_cfg(corpus, tokenizer_dir, out, max_steps=6, resume=True))  # and free for the next run


# -- 2. text input --------------------------------------------------------------------------------


def test_binary_data_is_refused(corpus, tokenizer_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "random.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    out = tmp_path / "run"
    assert main(_args(data, tokenizer_dir, out)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "random.txt: looks like a binary file" in line and line.endswith("(--data)")
    assert main(_args(corpus, tokenizer_dir, out, "--val-data", str(data / "random.txt"))) == 2
    assert _one_error_line(capsys.readouterr().err).endswith("(--val-data)")
    assert not out.exists()


def test_undecodable_bytes_are_reported_with_file_line_and_count(corpus, tokenizer_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    text = (corpus / "doc0.txt").read_text() + "\ncafé naïve\nthe end ü\n"
    (data / "latin1.txt").write_bytes(text.encode("latin-1"))
    check = check_text_file(str(data / "latin1.txt"))
    assert (check.invalid_bytes, check.first_invalid_line) == (3, 3)

    out = tmp_path / "run"
    assert main(_args(data, tokenizer_dir, out)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "latin1.txt:3: not UTF-8 (3 undecodable byte(s)" in line and "--accept-invalid-utf8" in line
    assert not out.exists()

    assert main(_args(data, tokenizer_dir, out, "--accept-invalid-utf8")) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "latin1.txt:3: not UTF-8 (3 undecodable byte(s)" in err and "U+FFFD" in err
    assert json.loads((out / "train_args.json").read_text())["accept_invalid_utf8"] is True


def test_reading_refuses_undecodable_bytes_unless_accepted(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"line one\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"a.txt:2: not UTF-8 \(1 undecodable byte"):
        list(read_documents([str(f)]))
    assert list(read_documents([str(f)], accept_invalid_utf8=True)) == ["line one\nbad \ufffd byte\n"]


# -- 3. every option checked before work starts -----------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--preset", "huge-efla"], "unknown preset 'huge-efla'; expected one of tiny-efla"),
        (["--max-steps", "0"], "expected a value >= 1, got 0 (--max-steps)"),
        (["--lr", "-1"], "expected a value > 0, got -1 (--lr)"),
        (["--lr", "1e-4", "--min-lr", "1e-3"], "above the peak --lr"),
        (["--batch-tokens", "100"], "not a whole number of 32-token sequences (--batch-tokens, --seq-len)"),
        (["--keep-checkpoints", "0"], "(--keep-checkpoints)"),
        (["--vocab-size", "10"], "(--vocab-size)"),
        (["--tokenizer", "./no-such-tokenizer"], "no such directory: ./no-such-tokenizer (--tokenizer)"),
        (["--resume-from", "no-such-checkpoint"], "(--resume-from)"),
        (["--val-data", "no-such-file.txt"], "no-such-file.txt: no such file or directory"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_options_fail_at_once_and_write_nothing(corpus, tokenizer_dir, tmp_path, capsys, extra, expected):
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out, *extra)) == 2
    assert expected in _one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_malformed_config_file_is_reported_with_its_line(corpus, tokenizer_dir, tmp_path, capsys):
    cfg = tmp_path / "model.json"
    cfg.write_text('{\n  "hidden_size": 64,\n  "num_hidden_layers": 2,\n  "num_heads": 4\n  "oops": 1\n}\n')
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out, "--config", str(cfg))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{cfg}:5: not valid JSON" in line and line.endswith("(--config)")
    cfg.write_text('{"hidden_size": 64,\n "not_a_field_of_efla": 1, "num_heads": 4}')
    assert main(_args(corpus, tokenizer_dir, out, "--config", str(cfg))) == 2
    assert f"{cfg}:2: unknown key 'not_a_field_of_efla' (--config)" in _one_error_line(capsys.readouterr().err)
    cfg.write_text('{"hidden_size": 64, "num_heads": -3}')
    assert main(_args(corpus, tokenizer_dir, out, "--config", str(cfg))) == 2
    assert "not a valid EFLAConfig" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_debug_shows_the_traceback(corpus, tokenizer_dir, tmp_path, monkeypatch):
    args = _args(corpus, tokenizer_dir, tmp_path / "run", "--preset", "huge-efla")
    with pytest.raises(UsageError, match="huge-efla"):
        main([*args, "--debug"])
    monkeypatch.setenv("EFLA_DEBUG", "1")
    with pytest.raises(UsageError, match="huge-efla"):
        main(args)


# -- 4. resume ------------------------------------------------------------------------------------


def test_resume_without_a_checkpoint_stops_unless_resume_or_start(corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out, "--resume")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "has no checkpoint to resume from" in line and "--resume-or-start" in line
    assert not out.exists()
    assert main(_args(corpus, tokenizer_dir, out, "--resume-or-start")) == 0
    assert len(read_log(str(out))) == 6
    assert main(_args(corpus, tokenizer_dir, out, "--resume-or-start", "--max-steps", "6")) == 0  # nothing left


def test_resume_refuses_changed_schedule_and_extends_at_min_lr_when_asked(corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out)) == 0
    capsys.readouterr()
    first = read_log(str(out))
    for extra, expected in (
        (["--max-steps", "10"], "--max-steps 6 -> 10"),
        (["--lr", "1e-3"], "--lr 0.003 -> 0.001"),
        (["--weight-decay", "0.3"], "--weight-decay 0.1 -> 0.3"),
        (["--max-steps", "4", "--extend-at-min-lr"], "--max-steps 6 -> 4"),
    ):
        assert main(_args(corpus, tokenizer_dir, out, "--resume", *extra)) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert expected in line and line.endswith("(--resume)"), line
    assert "--extend-at-min-lr" in _refusal(corpus, tokenizer_dir, out, capsys, "--max-steps", "10")
    assert read_log(str(out)) == first  # the refusals changed nothing

    # the README's 400 -> 800: the saved schedule to its planned end, then the extra steps at --min-lr
    assert main(_args(corpus, tokenizer_dir, out, "--resume", "--max-steps", "10", "--extend-at-min-lr")) == 0
    log = read_log(str(out))
    assert [e["step"] for e in log] == list(range(1, 11))
    assert [e["lr"] for e in log[:6]] == [e["lr"] for e in first]
    assert [e["lr"] for e in log[6:]] == pytest.approx([3e-4] * 4, rel=1e-12)
    assert first[-1]["lr"] == pytest.approx(3e-4, rel=1e-12)  # the cosine had reached --min-lr: no jump
    state = json.loads(pathlib.Path(list_checkpoints(str(out))[-1], "trainer_state.json").read_text())
    assert state["schedule"]["planned_steps"] == 6 and state["max_steps"] == 10
    # resuming the extended run again needs no new option: the choice is saved with the run
    assert main(_args(corpus, tokenizer_dir, out, "--resume", "--max-steps", "10")) == 0


def _refusal(corpus, tokenizer_dir, out, capsys, *extra) -> str:
    assert main(_args(corpus, tokenizer_dir, out, "--resume", *extra)) == 2
    return _one_error_line(capsys.readouterr().err)


def test_scheduled_lr_continues_at_min_lr_past_the_planned_steps():
    schedule = dict(planned_steps=10, warmup=2, lr=1.0, min_lr=0.1)
    assert scheduled_lr(0, schedule) == pytest.approx(0.1) and scheduled_lr(2, schedule) == pytest.approx(1.0)
    assert scheduled_lr(9, schedule) == pytest.approx(0.1)
    assert [scheduled_lr(s, schedule) for s in (10, 11, 500)] == [0.1, 0.1, 0.1]


# -- 9. nothing a checkpoint holds is unpickled -------------------------------------------------------


class _Planted:
    """A pickle whose loading would create a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.mark.parametrize("name", ["rng.pt", "optimizer.pt", "scheduler.pt"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_never_run(corpus, tokenizer_dir, tmp_path, capsys, name):
    out = tmp_path / "run"
    assert main(_args(corpus, tokenizer_dir, out)) == 0
    capsys.readouterr()
    ckpt = pathlib.Path(list_checkpoints(str(out))[-1])
    marker = tmp_path / "code-ran"
    torch.save({"state": _Planted(str(marker))}, ckpt / name)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    assert main(_args(corpus, tokenizer_dir, out, "--resume", "--max-steps", "6")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{name}: refused" in line and "could run code" in line
    assert not marker.exists()


def test_old_checkpoints_with_numpy_rng_state_still_resume(corpus, tokenizer_dir, tmp_path):
    import random

    out = tmp_path / "run"
    killed_at = {}

    def stop_at_3(step, entry):
        if step == 3:
            killed_at["step"] = step
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_cfg(corpus, tokenizer_dir, out), on_step_end=stop_at_3)
    ckpt = pathlib.Path(list_checkpoints(str(out))[-1])
    old_style = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}]
    torch.save(old_style, ckpt / "rng.pt")  # what efla wrote before its RNG states were plain tensors
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "rng.pt").read_bytes()
    manifest["files"]["rng.pt"] = dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    res = train(_cfg(corpus, tokenizer_dir, out, resume=True))
    assert res["steps"] == 6 and killed_at == {"step": 3}


def test_each_long_phase_is_announced_in_order_before_the_bar(corpus, tmp_path, capsys):
    args = [a for a in _args(corpus, "bpe", tmp_path / "run", "--vocab-size", "300") if a != "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    phases = [
        "efla train: training the tokenizer",
        "efla train: tokenizing (--data",
        "efla train: writing the token cache",
        "efla train: training steps 1-6",
        "efla train: writing the checkpoint of step 3",
        "efla train: writing the model directory",
    ]
    positions = [err.find(phase) for phase in phases]
    assert -1 not in positions and positions == sorted(positions), err
    assert err.find("train run") > positions[3]  # the bar comes after the line announcing it


def test_no_progress_announces_nothing(corpus, tokenizer_dir, tmp_path, capsys):
    assert main(_args(corpus, tokenizer_dir, tmp_path / "quiet", "--max-steps", "2")) == 0
    assert "efla train: " not in capsys.readouterr().err
