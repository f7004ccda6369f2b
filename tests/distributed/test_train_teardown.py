"""The end of ``efla train`` under torchrun: nothing that holds the process group outlives the cleanup
(left to the interpreter's exit, gloo's teardown can abort a finished rank)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from torch.nn.parallel import DistributedDataParallel

from efla.data.tokenizer import train_bpe_tokenizer
from efla.experiments.lm.train import TrainConfig, main_ddp_cleanup, train

from .spawn import run_in_processes

_WORDS = "the cat dog bird sat ran on under a mat tree house red small big".split()


@pytest.fixture()
def corpus_and_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = np.random.default_rng(0).choice(_WORDS, size=(200, 8))
    (corpus / "doc.txt").write_text("".join(" ".join(w) + ".\n" for w in words))
    text = [(corpus / "doc.txt").read_text()]
    train_bpe_tokenizer(text, vocab_size=300, save_dir=str(tmp_path / "tok"))
    return str(corpus), str(tmp_path / "tok")


def _wrappers_alive() -> int:
    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


def train_then_clean_up(rank: int, world: int, cfg: TrainConfig) -> tuple[int, int]:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    train(cfg)
    before = _wrappers_alive()
    main_ddp_cleanup(finished=True)
    return before, _wrappers_alive()


def test_cleanup_frees_the_ddp_wrapper_before_exit(corpus_and_tokenizer, tmp_path):
    corpus, tok = corpus_and_tokenizer
    out = str(tmp_path / "run")
    cfg = TrainConfig(data=[corpus], tokenizer=tok, out=out, cache_dir=out + "-cache", preset="tiny-efla",
                      seq_len=32, batch_tokens=128, micro_batch_size=2, max_steps=2, lr=3e-3, val_sequences=4,
                      save_every=0, progress=False, threads=1)
    results = run_in_processes(train_then_clean_up, 2, tmp_path / "workers", args=(cfg,))
    # train() returned, yet each rank's wrapper is still alive (a reference cycle) until the cleanup
    assert [before for before, _ in results] == [1, 1]
    assert [after for _, after in results] == [0, 0]
