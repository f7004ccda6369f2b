"""``benchmarks/gpu_distributed.py`` rehearsed on the CPU (gloo, tiny preset): every stage of the
several-GPU visit runs its torchrun processes and records what the visit would, so a lent machine's
minutes go to the runs themselves."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_WORDS = "the cat dog bird sat ran on under a mat tree house red small big and then saw".split()
STEPS, KILL_AT = 12, 4


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text("".join(" ".join(rng.choice(_WORDS, size=8)) + ".\n" for _ in range(400)))
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_distributed.py"),
        *("--data", str(corpus), "--out", str(out), "--work", str(work)),
        *("--stages", "ddp,resume,fsdp,cp,longest", "--preset", "tiny-efla", "--fsdp-preset", "tiny-efla"),
        *("--seq-len", "32", "--batch-tokens", "256", "--micro-batch-size", "2", "--steps", str(STEPS)),
        *("--save-every", "2", "--kill-at", str(KILL_AT), "--fsdp-steps", "2", "--val-sequences", "4"),
        *("--cp-tokens", "192", "--cp-dtype", "float32", "--cp-args", "--heads 2 --head-dim 16 --value-dim 16"),
        # the second length is past the corpus: a run that fails, as the longest stage's last one does
        *("--lengths", "64,10000000", "--length-steps", "2", "--vocab-size", "300", "--train-args", "--threads 1 --lr 3e-3"),
        *("--run-timeout", "240"),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}, (out / "distributed.md").read_text(), work


@pytest.mark.slow
def test_data_parallel_ranks_take_the_steps_of_one(rehearsal):
    results, report, _ = rehearsal
    runs = results["ddp"]["runs"]
    assert runs["1"]["ok"] and runs["2"]["ok"] and runs["2"]["world_size"] == 2
    assert len(runs["1"]["losses"]) == len(runs["2"]["losses"]) == STEPS
    assert np.abs(np.subtract(runs["1"]["losses"], runs["2"]["losses"])).max() < 1e-5
    assert runs["1"]["val_loss"] is not None and abs(runs["1"]["val_loss"] - runs["2"]["val_loss"]) < 1e-5
    assert "### Data parallelism" in report and results["ddp"]["meta"]["commands"][1].count("--nproc_per_node 2")


@pytest.mark.slow
def test_a_killed_rank_is_resumed_to_the_uninterrupted_losses(rehearsal):
    results, report, work = rehearsal
    r = results["resume"]
    assert r["killed_rank"] == 1 and r["killed_exit_status"] != 0
    assert KILL_AT <= len(r["losses_before_kill"]) < STEPS
    assert r["resumed"]["ok"] and r["resumed"]["losses"] == r["uninterrupted"]  # bitwise, on the CPU
    assert "(bitwise equal)" in report
    assert not (work / "resume").exists()  # run directories go once recorded


@pytest.mark.slow
def test_fsdp_context_parallel_and_longest_stages_record_their_runs(rehearsal):
    results, report, _ = rehearsal
    assert results["fsdp"]["run"]["ok"] and len(results["fsdp"]["run"]["losses"]) == 2
    cases = results["cp"]["cases"]
    assert results["cp"]["ok"] and {(c["rule"], c["case"]) for c in cases} == {
        (rule, case) for rule in ("efla", "gated_efla") for case in ("rows", "documents")
    }
    assert max(c["max_relative_error"]["split_vs_single"] for c in cases) < 1e-5
    longest = results["longest"]["runs"]
    assert [row["ok"] for row in longest["1"] + longest["2"]] == [True, False, True, False]
    failed = longest["2"][1]
    assert failed["error"].startswith("efla train:") and "--seq-len" in failed["error"], failed
    assert failed["error"] in failed["log_tail"]
    assert "--context-parallel 2" in results["longest"]["meta"]["commands"][-1]
    for heading in ("### FSDP2", "### Context parallelism", "### The longest sequence"):
        assert heading in report
