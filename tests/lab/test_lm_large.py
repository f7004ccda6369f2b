"""The corpus-large language-model plan end to end on the CPU at the tiny size: scripts/prep_lm_large.py
makes the carried data from a slice of the shared corpus, scripts/lm_large.sh (what the device's `lm`
phase runs) trains EFLA and DeltaNet side by side, evaluates both and packs the comparison; the two runs'
records show the same tokens in the same order. Skipped where the shared data folder is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from efla.data.shared import find_shared
from efla.records import read_records
from efla.training.trainer import TrainConfig, train
from efla_lab.lm.report import SAME_DATA_FIELDS, data_note

REPO = pathlib.Path(__file__).resolve().parents[2]
CORPUS = find_shared("corpus-large", "train-00.txt.xz")
NEEDED = [("corpus-large", "valid.txt.xz"), ("wikitext-2-raw", "wiki.test.raw"), ("lambada", "lambada_test.jsonl")]
SHARED = None if CORPUS is None or any(find_shared(*p) is None for p in NEEDED) else CORPUS.parents[1]
needs_shared = pytest.mark.skipif(
    SHARED is None, reason="the shared data folder (../shared/data with corpus-large, wikitext-2-raw, lambada) is absent"
)

TINY_PLAN = dict(
    LM_SIZE="tiny",
    LM_SEQ_LEN="64",
    LM_BATCH_TOKENS="256",
    LM_MICRO_BATCH="2",
    LM_TOKENS="1024",  # 4 steps
    LM_VAL_SEQUENCES="4",
    LM_VAL_EVERY="2",
    LM_SAVE_EVERY="2",
    LM_TRAIN_LIMIT="300",
    LM_DEVICE="cpu",
    LM_EVAL_ARGS="--wikitext-max-tokens 256 --limit 4 --batch-size 2 --threads 1",
)


def _load_prep():
    spec = importlib.util.spec_from_file_location("prep_lm_large", REPO / "scripts" / "prep_lm_large.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prep = _load_prep()
TINY_PREP = ["--train-mb", "0.3", "--valid-mb", "0.05", "--vocab-size", "300", "--tokenizer-chars", "200000"]


def _run(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", EFLA_DEBUG="1", **extra)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    if SHARED is None:
        pytest.skip("the shared data folder is absent")
    out = tmp_path_factory.mktemp("lm") / "data"
    assert prep.main(["--shared", str(SHARED), "--out", str(out), *TINY_PREP]) == 0
    return out


@needs_shared
def test_prep_is_deterministic_and_checked(tiny_data, tmp_path, capsys):
    manifest = json.loads((tiny_data / "manifest.json").read_text())
    files = manifest["files"]
    assert {"train.jsonl.xz", "valid.jsonl.xz", "wiki.test.raw", "lambada_test.jsonl", "tokenizer/tokenizer.json"} <= set(files)
    assert 300_000 <= files["train.jsonl.xz"]["text_bytes"] < 400_000  # the slice asked for, cut at a section
    assert files["train.jsonl.xz"]["tokens"] > files["valid.jsonl.xz"]["tokens"] > 0
    valid = [json.loads(line)["text"] for line in _xz_lines(tiny_data / "valid.jsonl.xz")]
    assert len(valid) > 5  # sections from across the held-out file, not its first book alone
    again = tmp_path / "again"
    assert prep.main(["--shared", str(SHARED), "--out", str(again), *TINY_PREP]) == 0
    assert json.loads((again / "manifest.json").read_text())["files"] == files  # same bytes, tokenizer included

    capsys.readouterr()
    (again / "valid.jsonl.xz").write_bytes(b"changed")
    assert prep.main(["--check", str(again)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"prep_lm_large.py: {again / 'valid.jsonl.xz'}: differs from the manifest (size or SHA-256) (--check)"
    )


def _xz_lines(path: pathlib.Path) -> list[str]:
    import lzma

    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [line for line in f if line.strip()]


def test_prep_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("a user's file")
    assert prep.main(["--shared", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prep_lm_large.py: ") and err.rstrip().endswith("(--shared)")
    if SHARED is not None:
        assert prep.main(["--shared", str(SHARED), "--out", str(tmp_path)]) == 2
        assert "not made by this script" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]


@pytest.mark.slow  # about a dozen Python processes, each importing torch: 1-2 minutes on 2 cores
@needs_shared
def test_both_variants_train_on_the_same_tokens_then_are_evaluated_and_compared(tiny_data, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    env = _env(**TINY_PLAN, LM_DATA=str(tiny_data), LM_WORK=str(work), OUT=str(out), PYTHON=sys.executable)
    # a first call out of time: both runs stop after their first step, nothing is evaluated yet
    cut = _run(["bash", "scripts/lm_large.sh"], dict(env, LM_TRAIN_LIMIT="0.000001"))
    assert cut.returncode == 1, cut.stdout[-3000:] + cut.stderr[-3000:]
    assert "0 of 2 runs finished" in cut.stdout
    for name in ("efla-s0", "deltanet-s0"):
        assert json.loads((work / name / "train_summary.json").read_text())["steps"] == 1
        assert not (work / name / "eval").exists()
    # the same call again resumes them, finishes, evaluates and compares
    done = _run(["bash", "scripts/lm_large.sh"], env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    assert len(list((work / "cache").glob("tokens-*.npy"))) == 2  # tokenized once: both runs read that cache
    runs = {r["run"]: r for r in read_records(str(work / "report" / "runs.jsonl"))}
    assert set(runs) == {"efla-s0", "deltanet-s0"}
    efla, deltanet = runs["efla-s0"]["train_summary"], runs["deltanet-s0"]["train_summary"]
    assert (efla["variant"], deltanet["variant"]) == ("efla", "deltanet")
    for summary in (efla, deltanet):
        assert (summary["steps"], summary["tokens"]) == (4, 1024)
        assert summary["data"]["sequences_trained"] == 16 and summary["data"]["val_sequences"] == 4
    assert {f: efla["data"][f] for f in SAME_DATA_FIELDS} == {f: deltanet["data"][f] for f in SAME_DATA_FIELDS}
    assert "Same data for every run: 16 sequences of 64 tokens" in (work / "report" / "summary.md").read_text()

    for name in runs:
        ev = runs[name]["eval"]
        assert 0 < ev["wikitext"]["bits_per_byte"] < 20 and ev["wikitext"]["tokens"] == 256
        assert ev["lambada"]["n"] == 4
    compared = json.loads((work / "compare" / "eval.json").read_text())
    assert sorted(m["variant"] for m in compared["models"]) == ["deltanet", "efla"]

    with tarfile.open(out / "lm-s0.tgz") as packed:
        names = set(packed.getnames())
    assert {"./report/runs.jsonl", "./report/summary.md", "./compare/table.md", "./efla-s0/log.jsonl"} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".pt", ".npy"))]

    # the order's hash follows the order: another data seed over the same tokens changes it and nothing else
    other = train(
        TrainConfig(
            preset="tiny-efla",
            data=[str(tiny_data / "train.jsonl.xz")],
            val_data=[str(tiny_data / "valid.jsonl.xz")],
            val_sequences=4,
            tokenizer=str(tiny_data / "tokenizer"),
            cache_dir=str(work / "cache"),
            seq_len=64,
            batch_tokens=256,
            max_tokens=1024,
            data_seed=1,
            threads=1,
            progress=False,
            out=str(tmp_path / "other-order"),
        )
    )
    moved = json.loads((tmp_path / "other-order" / "train_summary.json").read_text())["data"]
    assert other["steps"] == 4
    assert moved["tokens_sha256"] == efla["data"]["tokens_sha256"] and moved["val_sha256"] == efla["data"]["val_sha256"]
    assert moved["order_sha256"] != efla["data"]["order_sha256"]
    assert "did not train on the same data" in "".join(data_note([dict(data=efla["data"]), dict(data=moved)]))
