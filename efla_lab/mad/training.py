"""One MAD training run (``train_run``; several side by side on one GPU, ``train_side_by_side`` and
``MADRun``): AdamW with MAD-lab's schedule, an early stop at the target accuracy, the best epoch by
test perplexity, eager steps or captured CUDA-graph steps, and a partial run's state kept at most a
minute old so a killed run continues where it was."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from efla.cuda_graphs import capture
from efla_lab.data.mad_tasks import IGNORE, MADSetting, make_dataset
from efla_lab import harness
from efla.training.checkpoint import load_checkpoint_state

from efla_lab.mad.model import EARLY_STOP, RULES, STREAMS_PER_DEVICE, batch_loss_sums, build_model, scores, test_sums


@dataclass
class RunConfig:
    """Everything that determines one training run (the device and the time limit excepted)."""

    setting: MADSetting
    rule: str = "exact"
    lr: float = 5e-4
    weight_decay: float = 0.0
    epochs: int = 200
    batch_size: int = 128
    width: int = 128
    num_heads: int = 8
    blocks: int = 2
    seed: int = 12345
    precision: str = "fp32"  # or "bf16" (autocast)
    early_stop: float | None = EARLY_STOP

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {self.rule!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision: expected 'fp32' or 'bf16', got {self.precision!r}")

    @property
    def key(self) -> str:
        """File-name-safe identity of the run (used to store and resume it)."""
        k = (
            f"{self.setting.id}__{self.rule}__lr{self.lr:g}-wd{self.weight_decay:g}-e{self.epochs}-b{self.batch_size}"
            f"-w{self.width}-h{self.num_heads}-L{self.blocks}-s{self.seed}-{self.precision}"
        )
        if self.early_stop != EARLY_STOP:
            k += f"-es{self.early_stop}"
        return k

    def to_dict(self) -> dict:
        d = asdict(self)
        d["setting"] = self.setting.to_dict()
        return d


@dataclass
class _Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    leakage: float = 0.0


def tensors(dataset: dict, device) -> _Data:
    (a, b), (c, d) = dataset["train"], dataset["test"]
    t = [torch.as_tensor(np.asarray(v, dtype=np.int64), device=device) for v in (a, b, c, d)]
    return _Data(*t, leakage=dataset.get("leakage", 0.0))


STATE_FORMAT = 1  # the layout of a partial run's file


def _save_state(path: str, cfg: RunConfig, model, opt, sched, gen, progress: dict) -> None:
    """The run's state after an epoch, written whole or not at all."""
    state = dict(
        format=STATE_FORMAT,
        key=cfg.key,
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        scheduler=sched.state_dict(),
        generator=gen.get_state(),
        progress=progress,
    )
    harness.atomic_save_torch(path, state)


def _fresh_training(cfg: RunConfig, dev: torch.device):
    """Model, optimizer, schedule and data-order generator of a run's first epoch (the optimizer in
    its plain form; ``_set_step_form`` puts it in the form the run steps in)."""
    model = build_model(cfg.setting, cfg.rule, cfg.width, cfg.num_heads, cfg.blocks, seed=cfg.seed).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=1e-6)
    return model, opt, sched, torch.Generator().manual_seed(cfg.seed)


def _resume_state(path: str | None, cfg: RunConfig, model, opt, sched, gen) -> dict | None:
    """Load the state of an interrupted run of ``cfg`` from ``path`` (tensors and plain values only:
    nothing in the file runs) into the model, optimizer, schedule and generator, and return the
    progress so far; ``None`` when there is nothing to resume (no file, another run's, an unreadable
    or malformed one), in which case the objects may be half-loaded and must be built afresh."""
    if not path or not os.path.exists(path):
        return None
    try:
        state = load_checkpoint_state(path)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("key") != cfg.key:
            return None
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        progress = state["progress"]
        return dict(
            history=list(progress["history"]),
            best=progress["best"],
            steps=int(progress["steps"]),
            seconds=float(progress["seconds"]),
        )
    except Exception:  # noqa: BLE001  any damage: the run starts over rather than failing every call
        return None


def _eager_step(model, opt, xb, yb, vocab_size: int, bf16: bool) -> torch.Tensor:
    """One optimizer step on one batch; returns the batch's loss (on the device)."""
    with torch.autocast(device_type=xb.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(xb)
    loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), yb.reshape(-1), ignore_index=IGNORE)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


class GraphedBatches:
    """``fn(xb, yb)`` replayed from a CUDA graph for batches of ``batch_size`` rows; other batches, and the
    first ``warmup`` full ones (kernels load, autograd and the optimizer set up their state), call
    ``fn`` eagerly. The next full batch is captured and replayed, and so is every later one: a step
    of MAD's small models is mostly kernel launches, which a replay does in one. The result is the
    graph's own tensor, overwritten by the next replay.

    Everything runs in the stream of the first call, which must be the run's own: cuBLAS keeps a
    workspace per stream and a graph keeps the address of the one of the stream it was captured in,
    so graphs captured in one stream (PyTorch's default capture stream is one for all) share it and,
    replayed side by side, race on it."""

    def __init__(self, fn, batch_size: int, device: torch.device, warmup: int):
        self.fn, self.batch_size, self.device, self.warmup = fn, batch_size, device, warmup
        self.eager_calls = 0
        self.graph = self.stream = self.x = self.y = self.out = None

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self.device):
            self._keep_to_one_stream(torch.cuda.current_stream())
            if len(xb) != self.batch_size:
                return self.fn(xb, yb)
            if self.graph is None and self.eager_calls < self.warmup:
                self.eager_calls += 1
                return self.fn(xb, yb)
            if self.graph is None:
                self._capture(xb, yb)
            self.x.copy_(xb)
            self.y.copy_(yb)
            self.graph.replay()
            return self.out

    def release(self) -> None:
        """Destroy the graph once its replays are done. Destroying a graph may drop the cuBLAS workspace of
        its stream, so it must go before a later run gets that stream from PyTorch's pool."""
        if self.graph is not None:
            self.stream.synchronize()
            self.graph = self.x = self.y = self.out = None

    def _keep_to_one_stream(self, current: torch.cuda.Stream) -> None:
        if current == torch.cuda.default_stream():
            raise RuntimeError("graphed batches run in a stream of the run's own, not the default stream (which cannot capture)")
        if self.stream is None:
            self.stream = current
        elif current != self.stream:
            raise RuntimeError("graphed batches run in one stream throughout, the one their first call ran in")

    def _capture(self, xb, yb):
        """Record ``fn`` on static inputs; recording runs nothing, the replay after it does."""
        self.x, self.y = xb.clone(), yb.clone()
        self.graph, self.out = capture(lambda: self.fn(self.x, self.y), stream=self.stream)


class GraphedSteps(GraphedBatches):
    """``_eager_step`` (forward, loss, backward, AdamW) replayed from a CUDA graph after ``WARMUP`` eager
    steps. The optimizer's lr must be a device tensor that the schedule fills in place (see
    ``_set_step_form``)."""

    WARMUP = 3

    def __init__(self, model, opt, vocab_size: int, bf16: bool, batch_size: int, device: torch.device):
        super().__init__(
            functools.partial(_eager_step, model, opt, vocab_size=vocab_size, bf16=bf16), batch_size, device, self.WARMUP
        )
        self.opt = opt
        self.lr = opt.param_groups[0]["lr"]

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if self.opt.param_groups[0]["lr"] is not self.lr:  # the graph would go on with the lr it holds
            raise RuntimeError("the lr schedule replaced the optimizer's lr tensor instead of filling it in")
        return super().__call__(xb, yb)

    def _capture(self, xb, yb):
        self.opt.zero_grad(set_to_none=True)  # before recording: the captured backward makes them in the graph's memory
        super()._capture(xb, yb)

    def release(self) -> None:
        graphed = self.graph is not None
        super().release()
        if graphed:
            self.opt.zero_grad(set_to_none=True)  # the grads live in the graph's memory, which they would hold


def _set_step_form(opt, sched, graphed: bool, dev: torch.device) -> None:
    """Put the optimizer in the form this run steps in, whatever form a resumed state was saved in:
    graphed, AdamW's capturable form with the lr a device tensor and its step counts on the device;
    eager, the plain form with a float lr and step counts on the CPU. The schedule keeps float lrs
    (it then fills a tensor lr in place)."""
    for group in opt.param_groups:
        group["capturable"] = graphed
        lr = float(group["lr"])
        group["lr"] = torch.tensor(lr, device=dev) if graphed else lr
        if "initial_lr" in group:
            group["initial_lr"] = float(group["initial_lr"])
        for p in group["params"]:
            state = opt.state.get(p, {})
            if "step" in state:
                state["step"] = state["step"].to(p.device if graphed else "cpu")
    sched.base_lrs = [float(x) for x in sched.base_lrs]
    sched._last_lr = [float(x) for x in sched.get_last_lr()]


def train_run(
    cfg: RunConfig,
    dataset: dict | None = None,
    device: str = "cpu",
    time_limit: float | None = None,
    bar=None,
    checkpoint: str | None = None,
    checkpoint_every: float = 60.0,
    cuda_graph: bool = False,
) -> dict:
    """Train one model on one setting with the MAD recipe and return a plain dict.

    AdamW (weight decay on every parameter), cosine annealing stepped once per epoch to 1e-6,
    shuffled batches, test evaluation after every epoch, early stop once test accuracy exceeds
    ``cfg.early_stop``; the reported ``test_acc`` is the one of the epoch with the lowest test
    perplexity (MAD-lab's best checkpoint). ``time_limit`` (seconds) stops training early and
    marks the run ``truncated``. ``bar``: optional tqdm-like object (``update``, ``set_postfix``).

    ``checkpoint``: a file that holds the run's state after its last epoch, written at most every
    ``checkpoint_every`` seconds (the caller removes it once the result is stored), so that a run
    killed part-way resumes from there, with the same data order, when called again.

    ``cuda_graph`` (CUDA only): replay the training steps and the test batches from CUDA graphs
    (``GraphedSteps``, ``GraphedBatches``): the same arithmetic, apart from AdamW's capturable form,
    without a launch per kernel.
    """
    run = MADRun(cfg, dataset, device, time_limit, bar, checkpoint, checkpoint_every, cuda_graph)
    train_side_by_side([run])
    return run.result()


def train_side_by_side(runs: list, on_done=lambda _run: None) -> None:
    """Train ``MADRun``s to their end, side by side: each epoch, step ``i`` of every run, then every
    run's evaluation queued, then read; ``on_done(run)`` as each ends (to store it before the others end). On a GPU each
    run works in its own CUDA stream, so the small kernels (or graph replays) of several runs can
    share the GPU; each run's arithmetic is what it would be alone. Runs may have different settings."""
    streams = [r.stream for r in runs if r.stream is not None]
    if len(set(streams)) < len(streams):  # their work would serialize, their graphs share a cuBLAS workspace
        raise ValueError(
            f"runs: {len(runs)} runs side by side share CUDA streams; PyTorch lends at most "
            f"{STREAMS_PER_DEVICE} a device, so train at most that many together"
        )
    while True:
        active = [r for r in runs if not r.done]
        if not active:
            return
        for r in active:
            with r.in_stream():
                r.start_epoch()
        for i in range(max(r.batches_per_epoch for r in active)):
            for r in active:
                if i < r.batches_per_epoch and not r.truncated:
                    with r.in_stream():
                        r.step(i)
        for r in active:
            with r.in_stream():
                r.start_evaluation()
        for r in active:
            with r.in_stream():
                r.end_epoch()
            if r.done:
                on_done(r)


class MADRun:
    """One training run of ``train_run``, advanced a step at a time (``start_epoch``, ``step`` for each
    batch, ``start_evaluation``, ``end_epoch``, until ``done``; then ``result``), so that
    ``train_side_by_side`` can interleave several. On a GPU each call runs in the run's stream
    (``in_stream``)."""

    def __init__(
        self,
        cfg: RunConfig,
        dataset: dict | None = None,
        device: str = "cpu",
        time_limit: float | None = None,
        bar=None,
        checkpoint: str | None = None,
        checkpoint_every: float = 60.0,
        cuda_graph: bool = False,
    ):
        started = time.perf_counter()
        dev = torch.device(device)
        if cuda_graph and dev.type != "cuda":
            raise ValueError(f"cuda_graph: needs a CUDA device, got {device!r}")
        if dataset is None:
            dataset = make_dataset(cfg.setting, seed=cfg.seed)
        self.cfg, self.dev, self.time_limit, self.bar, self.cuda_graph = cfg, dev, time_limit, bar, cuda_graph
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        self.data = tensors(dataset, dev)
        self.model, self.opt, self.sched, self.gen = self._setup(checkpoint)
        self.bf16 = cfg.precision == "bf16"
        V = cfg.setting.vocab_size
        self.train_step = (
            GraphedSteps(self.model, self.opt, V, self.bf16, cfg.batch_size, dev)
            if cuda_graph
            else functools.partial(_eager_step, self.model, self.opt, vocab_size=V, bf16=self.bf16)
        )
        test_batch = functools.partial(batch_loss_sums, self.model, autocast=self.bf16)
        self.test_batch = GraphedBatches(test_batch, cfg.batch_size, dev, warmup=1) if cuda_graph else test_batch
        self.n = len(self.data.train_x)
        self.batches_per_epoch = math.ceil(self.n / cfg.batch_size)
        self.t0 = started - self.progress["seconds"]  # seconds count set-up and the earlier calls' training
        self.last_save = time.perf_counter()
        if bar is not None and self.steps:
            bar.update(self.steps)
        self.stopped_early = self.truncated = self.diverged = False
        self.done = len(self.history) >= cfg.epochs
        self.pending_test_sums = None  # from start_evaluation, for end_epoch
        self.seconds = None  # set when the run ends (a run side by side with others ends before them)
        # its own stream on a GPU, after the data it reads (made in the current stream)
        self.stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(dev))

    def _setup(self, checkpoint):
        cfg, dev = self.cfg, self.dev
        model, opt, sched, gen = _fresh_training(cfg, dev)
        progress = _resume_state(checkpoint, cfg, model, opt, sched, gen)
        if progress is None:
            if checkpoint and os.path.exists(checkpoint):  # a failed load may have filled them in part
                model, opt, sched, gen = _fresh_training(cfg, dev)
            progress = dict(history=[], best=None, steps=0, seconds=0.0)
        _set_step_form(opt, sched, self.cuda_graph, dev)
        self.progress = progress
        self.history, self.best, self.steps = progress["history"], progress["best"], progress["steps"]
        return model, opt, sched, gen

    def in_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def start_epoch(self) -> None:
        self.model.train()
        self.perm = torch.randperm(self.n, generator=self.gen).to(self.dev)
        self.loss_sum = torch.zeros((), device=self.dev)
        self.n_batches = 0

    def step(self, i: int) -> None:
        """The epoch's ``i``-th batch (in order; none after a truncation)."""
        idx = self.perm[i * self.cfg.batch_size : (i + 1) * self.cfg.batch_size]
        self.loss_sum += self.train_step(self.data.train_x[idx], self.data.train_y[idx])
        self.n_batches += 1
        self.steps += 1
        if self.bar is not None:
            self.bar.update(1)
        if self.time_limit is not None and time.perf_counter() - self.t0 > self.time_limit:
            self.truncated = True

    def start_evaluation(self) -> None:
        """Queue the epoch's evaluation (on a GPU the host goes on to the other runs' meanwhile)."""
        self.pending_test_sums = test_sums(
            self.model, self.data.test_x, self.data.test_y, self.cfg.batch_size, batch_sums=self.test_batch
        )

    def end_epoch(self) -> None:
        """After ``start_evaluation``: the schedule's step, the record and the stop rules; ``done`` when it ends."""
        cfg = self.cfg
        if self.pending_test_sums is None:
            raise RuntimeError("end_epoch: the epoch's evaluation was not started (start_evaluation)")
        train_loss = float(self.loss_sum) / max(self.n_batches, 1)
        lr_used = float(self.opt.param_groups[0]["lr"])
        self.sched.step()
        ev = scores(self.pending_test_sums, len(self.data.test_x))
        self.pending_test_sums = None
        rec = {
            "epoch": len(self.history) + 1,
            "train_loss": train_loss,
            "lr": lr_used,
            "test_acc": ev["acc"],
            "test_ppl": ev["ppl"],
            "test_token_acc": ev["token_acc"],
            "seconds": time.perf_counter() - self.t0,
        }
        self.history.append(rec)
        if math.isfinite(ev["ppl"]) and (self.best is None or ev["ppl"] < self.best["test_ppl"]):
            self.best = rec
        if self.bar is not None:
            self.bar.set_postfix(
                epoch=rec["epoch"], loss=f"{train_loss:.3f}", acc=f"{ev['acc']:.3f}", best=f"{(self.best or rec)['test_acc']:.3f}"
            )
        self.diverged = not math.isfinite(train_loss)
        self.stopped_early = not self.diverged and cfg.early_stop is not None and ev["acc"] > cfg.early_stop
        self.done = self.diverged or self.stopped_early or self.truncated or len(self.history) >= cfg.epochs
        if self.done:
            self.seconds = rec["seconds"]
            for graphed in (self.train_step, self.test_batch):
                if isinstance(graphed, GraphedBatches):
                    graphed.release()
        elif self.checkpoint and time.perf_counter() - self.last_save >= self.checkpoint_every:
            _save_state(
                self.checkpoint,
                cfg,
                self.model,
                self.opt,
                self.sched,
                self.gen,
                dict(history=self.history, best=self.best, steps=self.steps, seconds=time.perf_counter() - self.t0),
            )
            self.last_save = time.perf_counter()

    def result(self) -> dict:
        cfg, history = self.cfg, self.history
        best = self.best or history[-1]
        return {
            "key": cfg.key,
            "config": cfg.to_dict(),
            "task": cfg.setting.task,
            "setting": cfg.setting.id,
            "rule": cfg.rule,
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "test_acc": best["test_acc"],
            "test_ppl": best["test_ppl"],
            "test_token_acc": best["test_token_acc"],
            "best_epoch": best["epoch"],
            "max_test_acc": max(h["test_acc"] for h in history),
            "final_train_loss": history[-1]["train_loss"],
            "epochs_run": len(history),
            "steps": self.steps,
            "stopped_early": self.stopped_early,
            "truncated": self.truncated,
            "diverged": self.diverged,
            "time_limit": self.time_limit,
            "seconds": self.seconds if self.seconds is not None else time.perf_counter() - self.t0,
            "device": str(self.dev),
            "cuda_graph": self.cuda_graph,
            "leakage": self.data.leakage,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "history": history,
        }
