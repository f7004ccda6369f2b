"""Language-model training: data packing, the training loop, checkpoints, resume,
torchrun/DDP, and the self-contained model directory. Tiny sizes, one thread, CPU only, no network."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from efla.data.text import (
    SequenceOrder,
    count_targets,
    make_batch,
    rank_slice,
    read_documents,
    split_train_val,
    strip_gutenberg,
)
from efla.data.tokenizer import train_bpe_tokenizer
from efla.errors import UsageError
from efla.training.trainer import (
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    list_checkpoints,
    lr_at,
    read_log,
    train,
    verify_checkpoint,
    warmup_steps,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus"

_WORDS = (
    "the cat dog bird sat ran flew on under over a mat tree house red green small big and then quickly slowly saw heard"
).split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """A small, learnable text corpus: a directory of .txt files and a .jsonl file of sentences from a
    toy grammar (seeded)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)

    def sentence():
        w = lambda: _WORDS[rng.integers(len(_WORDS))]  # noqa: E731
        return f"{w()} {w()} sat on the {w()}. then the {w()} ran {w()} the {w()}.\n"

    for i in range(3):
        (root / f"doc{i}.txt").write_text("".join(sentence() for _ in range(120)))
    with open(root / "more.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": "".join(sentence() for _ in range(5))}) + "\n")
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(read_documents([str(corpus)]), vocab_size=320, save_dir=str(d))
    return str(d)


def _cfg(corpus, tokenizer_dir, out, **kw) -> TrainConfig:
    base = dict(
        data=[str(corpus)],
        out=str(out),
        preset="tiny-efla",
        tokenizer=tokenizer_dir,
        seq_len=32,
        batch_tokens=128,
        micro_batch_size=2,
        max_steps=12,
        lr=3e-3,
        min_lr=3e-4,
        val_sequences=8,
        save_every=4,
        progress=False,
        threads=1,
        cache_dir=str(out) + "-cache",
    )
    base.update(kw)
    return TrainConfig(**base)


# -- data ------------------------------------------------------------------------------------------


def test_documents_packing_order_and_sharding(corpus, tokenizer_dir):
    docs = list(read_documents([str(corpus)]))
    assert len(docs) == 3 + 40  # 3 text files + 40 JSONL lines, directory expanded in sorted order
    g = (
        "header\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nbody line\r\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicence"
    )
    assert strip_gutenberg(g.replace("\r\n", "\n")) == "body line\n"

    tokens = np.arange(1000, dtype=np.int32)
    tr, va = split_train_val(tokens, 10, val_sequences=7, val_seed=3)
    assert len(tr) + len(va) == 100 and not set(tr.index) & set(va.index)
    assert (tr.sequences([0])[0] == tokens[tr.index[0] * 10 : tr.index[0] * 10 + 10]).all()

    order = SequenceOrder(10, seed=5)
    first_two_epochs = order.take(0, 20)
    assert sorted(first_two_epochs[:10]) == list(range(10)) and sorted(first_two_epochs[10:]) == list(range(10))
    assert not (first_two_epochs[:10] == first_two_epochs[10:]).all()  # reshuffled each epoch
    assert (order.take(7, 6) == first_two_epochs[7:13]).all()  # a position resumes across an epoch boundary
    assert (SequenceOrder(10, seed=5).take(3, 4) == first_two_epochs[3:7]).all()  # deterministic
    glob = order.take(0, 8)
    assert (np.concatenate([rank_slice(glob, r, 2) for r in range(2)]) == glob).all()

    seqs = np.array([[5, 2, 6, 7], [8, 9, 2, 3]])  # eos = 2
    b = make_batch(seqs, eos_id=2, varlen=True)
    assert b["input_ids"].shape == (1, 8)
    assert b["cu_seqlens"].tolist() == [0, 2, 4, 7, 8]
    assert count_targets(b) == 1 + 1 + 2 + 0
    assert count_targets(make_batch(seqs)) == 2 * 3


def test_steady_state_throughput_leaves_out_the_warm_up_steps():
    from efla.training.trainer import throughput

    slow_start = [30.0, 4.0] + [0.5] * 8  # kernel compilation in the first steps
    t = throughput(slow_start, batch_tokens=1000)
    assert t["steady_state_steps"] == 5 and t["tokens_per_s"] == 2000.0
    assert abs(t["tokens_per_s_all_steps"] - 10_000 / 38.0) < 1e-9
    assert throughput([2.0, 1.0], 100)["tokens_per_s"] == 100.0  # short runs keep at least half their steps
    assert throughput([], 100)["tokens_per_s"] is None


def test_lr_schedule_paper_recipe():
    lrs = [lr_at(s, 100, 10, 3e-4, 3e-5) for s in range(100)]
    assert lrs[0] == pytest.approx(3e-5) and lrs[10] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11])) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


# -- the loop ---------------------------------------------------------------------------------------


def test_loss_decreases_and_model_dir_loads(corpus, tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import efla  # noqa: F401  (registers the Auto classes)

    res = train(_cfg(corpus, tokenizer_dir, tmp_path / "run", max_steps=40, val_every=20))
    losses = res["losses"]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert losses[0] > math.log(320) - 0.3  # ~uniform at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses[::5]
    vals = [e["val_loss"] for e in res["log"] if "val_loss" in e]
    assert len(vals) == 2 and vals[1] < vals[0] and res["val_loss"] == vals[1]

    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    steady = [e["step_s"] for e in res["log"] if e["step"] > 5]  # every step is logged at log_every=1
    assert summary["steady_state_steps"] == 35 and len(steady) == 35
    batch = summary["tokens"] / 40
    assert abs(summary["tokens_per_s"] - 35 * batch / sum(steady)) <= 1e-6 * summary["tokens_per_s"]
    assert all(abs(e["tokens_per_s"] * e["step_s"] - batch) < 1e-6 * batch for e in res["log"])
    assert summary["peak_memory_gib_per_gpu"] is None  # CPU run

    out = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "EFLAForCausalLM" and model.config.vocab_size == len(tok)
    from safetensors.torch import load_file

    final_ckpt = load_file(os.path.join(list_checkpoints(str(out))[-1], "model.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, final_ckpt[k]), k
    text = "the cat sat on the mat."
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 4)


def test_resume_after_kill_reproduces_uninterrupted_run(corpus, tokenizer_dir, tmp_path):
    ref = train(_cfg(corpus, tokenizer_dir, tmp_path / "ref"))

    class Killed(Exception):
        pass

    def kill_at_7(step, entry):
        if step == 7:  # after the step-4 checkpoint and three more logged steps
            raise Killed

    out = tmp_path / "killed"
    with pytest.raises(Killed):
        train(_cfg(corpus, tokenizer_dir, out), on_step_end=kill_at_7)
    assert [os.path.basename(p) for p in list_checkpoints(str(out))] == ["step-0000004"]
    assert [e["step"] for e in read_log(str(out))] == list(range(1, 8))
    # a checkpoint being written when the process died: a temp dir, never taken for a checkpoint
    shutil.copytree(out / "checkpoints" / "step-0000004", out / "checkpoints" / ".tmp-step-0000008-999")
    with pytest.raises(UsageError, match="already has checkpoints"):
        train(_cfg(corpus, tokenizer_dir, out))  # without --resume an existing run is not clobbered

    res = train(_cfg(corpus, tokenizer_dir, out, resume=True))
    assert res["resumed_from"].endswith("step-0000004")
    assert res["losses"] == ref["losses"]  # bitwise: same floats, every one of the 12 steps
    assert [e["step"] for e in res["log"]] == list(range(1, 13))
    assert res["val_loss"] == ref["val_loss"]
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_corrupted_or_truncated_checkpoint_is_refused(corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "run"
    ref = train(_cfg(corpus, tokenizer_dir, out))
    ckpts = list_checkpoints(str(out))
    assert [os.path.basename(p) for p in ckpts] == ["step-0000004", "step-0000008", "step-0000012"]
    for p in ckpts:
        verify_checkpoint(p)
    latest, previous = ckpts[-1], ckpts[-2]

    # one flipped byte in the weights
    f = os.path.join(latest, "model.safetensors")
    data = bytearray(pathlib.Path(f).read_bytes())
    data[len(data) // 2] ^= 0x10
    pathlib.Path(f).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its SHA-256") as ei:
        train(_cfg(corpus, tokenizer_dir, out, resume=True))
    assert previous in str(ei.value) and "--resume-from" in str(ei.value)
    from efla.cli import main  # the command line reports it and exits with status 2

    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2  # the rest from train_args.json
    assert "refusing to resume" in capsys.readouterr().err

    data[len(data) // 2] ^= 0x10  # repaired; now a truncated optimizer state (as from a full disk)
    pathlib.Path(f).write_bytes(bytes(data))
    verify_checkpoint(latest)
    f = os.path.join(latest, "optimizer.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(CheckpointError, match="optimizer.pt has .* bytes.*truncated") as ei:
        train(_cfg(corpus, tokenizer_dir, out, resume=True))
    assert previous in str(ei.value)

    # no manifest: incomplete
    os.remove(os.path.join(latest, "manifest.json"))
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(latest)

    # the named previous checkpoint resumes (command line, options from train_args.json) and reproduces the
    # last four steps
    assert main(["train", "--out", str(out), "--resume-from", previous]) == 0
    assert [e["loss"] for e in read_log(str(out))] == ref["losses"]


def test_non_finite_loss_stops_with_clear_message_and_keeps_checkpoint(corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "run"

    def poison(step, entry):
        if step == 5:
            with torch.no_grad():
                next(iter(torch.nn.Module.parameters(poison.model))).fill_(float("nan"))

    # reach the model through the optimizer-free route: patch EFLAForCausalLM.__init__ to record it
    from efla.models import EFLAForCausalLM

    orig = EFLAForCausalLM.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        poison.model = self

    EFLAForCausalLM.__init__ = init
    try:
        with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 6.*last good checkpoint is .*step-0000004"):
            train(_cfg(corpus, tokenizer_dir, out), on_step_end=poison)
        verify_checkpoint(list_checkpoints(str(out))[-1])
        assert [os.path.basename(p) for p in list_checkpoints(str(out))] == ["step-0000004"]

        res = train(_cfg(corpus, tokenizer_dir, tmp_path / "skip", on_nonfinite="skip", max_steps=7), on_step_end=poison)
        assert [e.get("skipped") for e in res["log"]] == [None] * 5 + ["non-finite"] * 2
    finally:
        EFLAForCausalLM.__init__ = orig


def test_varlen_packing_and_grad_accumulation_agree(corpus, tokenizer_dir, tmp_path):
    # accumulation over 2 micro-batches == one forward of the same 4 sequences (same global mean)
    a = train(_cfg(corpus, tokenizer_dir, tmp_path / "a", max_steps=3, micro_batch_size=2, save_every=0))
    b = train(_cfg(corpus, tokenizer_dir, tmp_path / "b", max_steps=3, micro_batch_size=4, save_every=0))
    assert np.allclose(a["losses"], b["losses"], rtol=0, atol=2e-6)
    v = train(_cfg(corpus, tokenizer_dir, tmp_path / "v", max_steps=3, varlen=True, save_every=0))
    # documents cut at eos: the first loss differs slightly but is still ~uniform, then it learns
    assert all(math.isfinite(x) for x in v["losses"]) and abs(v["losses"][0] - a["losses"][0]) < 0.2


# -- torchrun -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_processes_match_single_process(corpus, tokenizer_dir, tmp_path):
    common = [
        "--data",
        str(corpus),
        "--tokenizer",
        tokenizer_dir,
        "--seq-len",
        "32",
        "--batch-tokens",
        "256",
        "--max-steps",
        "5",
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--val-sequences",
        "8",
        "--threads",
        "1",
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    single = train(
        _cfg(
            corpus,
            tokenizer_dir,
            tmp_path / "single",
            batch_tokens=256,
            max_steps=5,
            micro_batch_size=8,
            save_every=0,
            cache_dir=str(tmp_path / "cache"),
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "efla",
        "train",
        *common,
        "--micro-batch-size",
        "2",
        "--out",
        str(tmp_path / "ddp"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = json.loads((tmp_path / "ddp" / "train_args.json").read_text())
    assert args["resolved"]["world_size"] == 2 and args["resolved"]["accum"] == 2
    ddp = [e["loss"] for e in read_log(str(tmp_path / "ddp"))]
    assert len(ddp) == 5
    assert np.abs(np.array(ddp) - np.array(single["losses"])).max() < 1e-5, (ddp, single["losses"])
    # rank 0 alone wrote: one log line per step, one checkpoint, a loadable model directory
    assert len(list_checkpoints(str(tmp_path / "ddp"))) == 1
    assert (tmp_path / "ddp" / "model.safetensors").exists()


# -- tokenizer on the shared corpus -----------------------------------------------------------------


def test_tokenizer_trained_on_shared_corpus_saved_with_model(tmp_path):
    if not SHARED_CORPUS.is_dir():
        pytest.skip(f"{SHARED_CORPUS} not found (the shared data folder beside the repository)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import efla  # noqa: F401

    src = sorted(SHARED_CORPUS.rglob("*.txt"))
    assert src, "no .txt files in the shared corpus"
    data = tmp_path / "slice"
    data.mkdir()
    for p in src[:3] + [SHARED_CORPUS / "tinyshakespeare" / "input.txt"]:
        if p.exists():  # the first 60 kB of a few books: a small slice keeps the test fast
            (data / p.name).write_bytes(p.read_bytes()[:60_000])
    out = tmp_path / "model"
    res = train(
        TrainConfig(
            data=[str(data)],
            out=str(out),
            preset="tiny-gated-efla",
            vocab_size=600,
            seq_len=32,
            batch_tokens=128,
            max_steps=3,
            val_sequences=4,
            progress=False,
            threads=1,
        )
    )
    assert res["steps"] == 3
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert 300 < len(tok) <= 600 and model.config.vocab_size == len(tok) and model.config.gated
    assert (
        (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        == (0, 1, 2)
        == (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id)
    )
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) * 0.7  # merges were learned
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_lm_report_names_the_preset_or_the_config_file(corpus, tokenizer_dir, tmp_path):
    from efla.data.tokenizer import load_tokenizer
    from efla_lab.lm.report import collect_runs, summary_markdown
    from efla.models import get_preset_config

    config_file = tmp_path / "small.json"
    get_preset_config("tiny-efla", vocab_size=len(load_tokenizer(tokenizer_dir))).to_json_file(config_file)
    train(_cfg(corpus, tokenizer_dir, tmp_path / "by-preset", max_steps=2))
    train(_cfg(corpus, tokenizer_dir, tmp_path / "by-config", max_steps=2, preset=None, config_file=str(config_file)))
    by_preset = summary_markdown(collect_runs([str(tmp_path / "by-preset")]), "t", "", "")
    by_config = summary_markdown(collect_runs([str(tmp_path / "by-config")]), "t", "", "")
    assert "1 runs; each: preset `tiny-*`" in by_preset
    assert "1 runs; each: config small.json" in by_config


def test_lm_report_summarises_eval_results_with_sample_spread(corpus, tokenizer_dir, tmp_path):
    from efla_lab.lm.report import collect_runs, summary_markdown

    runs = []
    for seed, word_ppl, acc in ((0, 100.0, 0.25), (1, 110.0, 0.35)):
        run = tmp_path / f"efla-s{seed}"
        train(_cfg(corpus, tokenizer_dir, run, max_steps=2, seed=seed))
        (run / "eval").mkdir()
        (run / "eval" / "eval.json").write_text(
            json.dumps(
                {
                    "resolved_context": 64,
                    "wikitext": {
                        "word_perplexity": word_ppl,
                        "bits_per_byte": 1.5 + seed,
                        "token_perplexity": 50.0,
                        "tokens": 1000,
                        "truncated_to_tokens": None,
                    },
                    "lambada": {"accuracy": acc, "perplexity": 20.0, "n": 40, "limit": 40, "passages_in_file": 5153},
                }
            )
        )
        runs.append(str(run))
    text = summary_markdown(collect_runs(runs), "t", "", "")
    row = next(line for line in text.splitlines() if line.startswith("| EFLA |"))
    # mean ± sample standard deviation of two runs: 105 ± 7.07, 2.0 ± 0.707, 0.30 ± 0.0707
    assert "| 105.0 ± 7.1 | 2.0000 ± 0.7071 | 0.3000 ± 0.0707 | 20.0 ± 0.0 |" in row
    assert "context 64 tokens; LAMBADA: 40 of 5,153 passages" in text and "WikiText: first" not in text
    # a record keeps the runs as lines of one runs.jsonl: the same report from it
    from efla import records
    from efla_lab.lm.report import stored_run

    records.write_records(str(tmp_path / "runs.jsonl"), [stored_run(r) for r in runs])
    assert summary_markdown(collect_runs([str(tmp_path / "runs.jsonl")]), "t", "", "") == text


def test_resuming_a_finished_run_keeps_its_validation_loss_and_rate(corpus, tokenizer_dir, tmp_path):
    """A resumed process with nothing left to train (a device visit re-run after the runs finished)
    keeps the run's last validation loss; the report takes the rate from the log."""
    from efla_lab.lm.report import collect_runs

    out = tmp_path / "run"
    first = train(_cfg(corpus, tokenizer_dir, out, max_steps=4, save_every=2, val_every=2))
    again = train(_cfg(corpus, tokenizer_dir, out, max_steps=4, save_every=2, val_every=2, resume=True))
    assert again["tokens_per_s"] is None and again["steps"] == 4
    assert again["val_loss"] == first["val_loss"] is not None
    row = collect_runs([str(out)])[0]
    step_seconds = [e["step_s"] for e in read_log(str(out))]
    assert row["val_loss"] == first["val_loss"]
    # the rate of the steps after warm-up, as the training summary defines it, over the whole log
    steady = step_seconds[warmup_steps(4) :]
    assert row["tokens_per_s"] == pytest.approx(len(steady) * 128 / sum(steady)) and row["tokens_per_s"] > 0
    assert row["train_seconds"] == pytest.approx(sum(step_seconds))
