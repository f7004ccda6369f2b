"""``efla train --context-parallel N``: the option, and training steps split over 2 gloo processes
giving the losses of one process; the end of training on several processes: nothing that holds the
process group outlives the cleanup (left to the interpreter's exit, gloo's teardown can abort a
finished rank)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from torch.nn.parallel import DistributedDataParallel

from efla import environment
from efla.cli import build_parser
from efla.data.text import read_documents
from efla.data.tokenizer import train_bpe_tokenizer
from efla.training.trainer import TrainConfig, main_ddp_cleanup, train

from .layer_hook import token_mixers_routed
from .spawn import run_in_processes

STEPS = 3
_WORDS = "the cat dog bird sat ran on under a mat tree house red small big and then saw".split()


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp-corpus")
    rng = np.random.default_rng(0)
    for i in range(2):
        words = rng.choice(_WORDS, size=(200, 8))
        (root / f"doc{i}.txt").write_text("".join(" ".join(w) + ".\n" for w in words))
    tok = tmp_path_factory.mktemp("cp-tok")
    train_bpe_tokenizer(read_documents([str(root)]), vocab_size=300, save_dir=str(tok))
    return str(root), str(tok)


def _config(corpus: str, tokenizer: str, out: str, **overrides) -> TrainConfig:
    base = dict(
        data=[corpus],
        tokenizer=tokenizer,
        out=out,
        cache_dir=out + "-cache",
        preset="tiny-efla",
        seq_len=32,
        batch_tokens=128,
        micro_batch_size=2,
        max_steps=STEPS,
        lr=3e-3,
        min_lr=3e-4,
        val_sequences=4,
        save_every=0,
        progress=False,
        threads=1,
    )
    return TrainConfig(**{**base, **overrides})


def _losses_and_grad_norms(summary: dict) -> np.ndarray:
    return np.array([[e["loss"], e["grad_norm"]] for e in summary["log"]])


def train_split(rank: int, world: int, configs: list) -> list:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    environment.reload()  # as torchrun would have set them before the process started
    with token_mixers_routed():
        summaries = [train(cfg) for cfg in configs]
    return [_losses_and_grad_norms(s) for s in summaries] if rank == 0 else None


def test_option_reaches_the_train_config():
    args = build_parser().parse_args(["train", "--out", "x", "--context-parallel", "4"])
    assert TrainConfig(**{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}).context_parallel == 4


def test_context_parallel_needs_processes(corpus_and_tokenizer, tmp_path):
    corpus, tok = corpus_and_tokenizer
    with pytest.raises(ValueError, match="context_parallel"):
        train(_config(corpus, tok, str(tmp_path / "one"), context_parallel=2))


def _compare(tmp_path, corpus, tok, world: int, context_parallel: int, cases: list[dict]) -> None:
    single = [_losses_and_grad_norms(train(_config(corpus, tok, str(tmp_path / f"single{i}"), **c))) for i, c in enumerate(cases)]
    configs = [
        _config(corpus, tok, str(tmp_path / f"split{i}"), context_parallel=context_parallel, **c) for i, c in enumerate(cases)
    ]
    split = run_in_processes(train_split, world, tmp_path / "workers", args=(configs,))[0]
    for case, a, b in zip(cases, single, split):
        assert b.shape == (STEPS, 2)
        # float32: the split sums the loss and the gradients in another order
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=0, err_msg=str(case))
    print(
        "max relative difference (loss, grad norm):",
        np.max([np.abs(b / a - 1).max(axis=0) for a, b in zip(single, split)], axis=0),
    )


@pytest.mark.slow
def test_train_split_over_two_processes_matches_one(corpus_and_tokenizer, tmp_path):
    corpus, tok = corpus_and_tokenizer
    _compare(tmp_path, corpus, tok, 2, 2, [dict(preset="tiny-efla"), dict(preset="tiny-gated-efla", varlen=True)])


@pytest.mark.slow
def test_train_two_data_parallel_groups_of_two_match_one_process(corpus_and_tokenizer, tmp_path):
    corpus, tok = corpus_and_tokenizer
    _compare(tmp_path, corpus, tok, 4, 2, [dict(preset="tiny-gated-efla", varlen=True)])


@pytest.mark.slow
def test_checkpointed_blocks_recompute_inside_the_split(corpus_and_tokenizer, tmp_path):
    """Recomputed in the backward, outside the forward's scope, a block would run its part as a whole
    sequence (torch's checkpoint then refuses it: other tensors saved than in the forward)."""
    corpus, tok = corpus_and_tokenizer
    _compare(tmp_path, corpus, tok, 2, 2, [dict(preset="tiny-gated-efla", varlen=True, grad_checkpointing=True)])


def _wrappers_alive() -> int:
    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


def train_then_clean_up(rank: int, world: int, cfg: TrainConfig) -> tuple[int, int]:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    environment.reload()  # as torchrun would have set them before the process started
    train(cfg)
    before = _wrappers_alive()
    main_ddp_cleanup(finished=True)
    return before, _wrappers_alive()


def test_cleanup_frees_the_ddp_wrapper_before_exit(corpus_and_tokenizer, tmp_path):
    corpus, tok = corpus_and_tokenizer
    cfg = _config(corpus, tok, str(tmp_path / "run"), max_steps=2)
    results = run_in_processes(train_then_clean_up, 2, tmp_path / "workers", args=(cfg,))
    # train() returned, yet each rank's wrapper is still alive (a reference cycle) until the cleanup
    assert [before for before, _ in results] == [1, 1]
    assert [after for _, after in results] == [0, 0]
