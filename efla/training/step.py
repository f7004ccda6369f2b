"""One optimizer step of ``efla train``: the forward and backward over this rank's share of the
global batch (accumulated over micro-batches), gradient clipping, the update or, on a non-finite
loss, a skipped batch or a stopped run; and the validation loss when it is due."""

from __future__ import annotations

import contextlib
import json
import math
import time

import numpy as np
import torch

from efla.data.text import count_targets, make_batch, rank_slice
from efla.distributed import context_parallel_lm_loss
from efla.errors import NonFiniteValues

from efla.training.config import Sizes
from efla.training.process_group import Dist
from efla.training.session import Progress, Session

__all__ = ["NonFiniteLossError", "train_step", "validation_loss"]


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) of a step was NaN or infinite; the step was not applied."""


def validation_loss(model, val, r: Sizes, dist: Dist, eos_id: int, varlen: bool, autocast) -> float | None:
    """The mean next-token loss over the validation sequences, all ranks together (``nan`` when the
    weights are no longer finite; ``None`` without validation data)."""

    if val is None or len(val) == 0:
        return None
    n = (len(val) // dist.world) * dist.world
    if n == 0:
        return None
    idx = np.arange(n)[dist.rank * (n // dist.world) : (dist.rank + 1) * (n // dist.world)]
    core = model  # the bare model (DDP) or the FSDP root (every rank takes part in its all-gathers)
    was = core.training
    core.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    dev = next(core.parameters()).device
    with torch.no_grad():
        for s in range(0, len(idx), r.micro):
            batch = make_batch(val.sequences(idx[s : s + r.micro]), eos_id, varlen)
            batch = {k: v.to(dev) for k, v in batch.items()}
            try:
                with autocast():
                    loss = core(**batch, use_cache=False).loss
            except NonFiniteValues:  # non-finite weights (every rank has the same ones)
                core.train(was)
                return float("nan")
            c = count_targets(batch)
            tot += torch.tensor([loss.double().item() * c, c], dtype=torch.float64)
    if dist.enabled:
        t = tot.to(dev) if dev.type == "cuda" else tot
        torch.distributed.all_reduce(t)
        tot = t.cpu()
    core.train(was)
    return float(tot[0] / tot[1]) if tot[1] > 0 else None


def train_step(run: Session, progress: Progress, log_f, bar) -> dict:
    """One update (or a skipped batch): its log entry; the validation loss when due."""
    cfg, r = run.cfg, run.r
    t0 = time.perf_counter()
    step_loss, forward_error = _forward_backward(run, progress.step)
    gnorm = _clip_gradients(run) if forward_error is None else float("nan")
    lr_used = run.optimizer.param_groups[0]["lr"]
    skipped = _apply_update(run, progress, step_loss, gnorm, forward_error, log_f)
    run.scheduler.step()
    progress.step += 1
    step = progress.step
    dt = time.perf_counter() - t0
    progress.train_time += dt
    progress.step_seconds.append(dt)
    entry = dict(
        step=step,
        loss=step_loss,
        lr=lr_used,
        grad_norm=gnorm,
        tokens=step * r.batch_tokens,
        tokens_per_s=r.batch_tokens / dt if dt > 0 else 0.0,
        step_s=dt,
        epoch=run.order.epoch_of(step * r.global_seqs),
    )
    if run.device.type == "cuda":
        entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    if skipped:
        entry["skipped"] = "non-finite"
        if bar is not None:
            bar.write(f"step {step}: non-finite loss/grad ({step_loss}, {gnorm}); batch skipped")
    if (cfg.val_every and step % cfg.val_every == 0) or step == r.max_steps:
        progress.val_loss = validation_loss(
            run.wrapped if cfg.fsdp else run.model, run.val_data, r, run.dist, run.eos_id, cfg.varlen, run.autocast
        )
        if progress.val_loss is not None:
            entry["val_loss"] = progress.val_loss
    return entry


def _forward_backward(run: Session, step: int) -> tuple[float, str | None]:
    """Forward and backward over this rank's share of the global batch of ``step``, accumulated over
    micro-batches. Returns the global mean loss and, if the ops refused a non-finite value, why."""

    cfg, r, dist, cp = run.cfg, run.r, run.dist, run.cp
    G, L = r.global_seqs, r.seq_len
    global_idx = run.order.take(step * G, G)
    if cfg.varlen:
        n_global = sum(
            count_targets(make_batch(run.train_data.sequences(global_idx[i : i + 1]), run.eos_id, True)) for i in range(G)
        )
    else:
        n_global = G * (L - 1)
    data_rank, data_world = (cp.data_rank, cp.data_world) if cp else (dist.rank, dist.world)
    mine = rank_slice(global_idx, data_rank, data_world)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    forward_error = None
    for i in range(r.accum):
        batch = make_batch(run.train_data.sequences(mine[i * r.micro : (i + 1) * r.micro]), run.eos_id, cfg.varlen)
        n_mb = count_targets(batch)
        batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
        try:
            with _gradient_sync(run, last=i == r.accum - 1):
                with run.autocast():
                    loss = context_parallel_lm_loss(run.wrapped, batch, cp) if cp else run.wrapped(**batch, use_cache=False).loss
                (loss * (n_mb * dist.world / n_global)).backward()
        except NonFiniteValues as e:  # the ops refuse non-finite inputs (always on CPU)
            forward_error = str(e)
            break
        loss_sum += loss.detach().double() * n_mb
    if forward_error is not None:
        loss_sum.fill_(float("nan"))
        if dist.enabled and cfg.on_nonfinite == "skip":  # the other ranks wait in collectives: cannot skip
            raise NonFiniteLossError(
                f"non-finite values in the forward at step {step + 1} on rank "
                f"{dist.rank} ({forward_error}); --on-nonfinite skip needs the loss to "
                "be the first non-finite value under torchrun"
            )
    elif dist.enabled:
        torch.distributed.all_reduce(loss_sum)
    return float(loss_sum.cpu() / n_global), forward_error


def _gradient_sync(run: Session, last: bool):
    """Gradients are reduced across ranks on the last micro-batch of a step only."""
    if run.cfg.fsdp:
        run.wrapped.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if run.dist.enabled and not last:
        return run.wrapped.no_sync()
    return contextlib.nullcontext()


def _clip_gradients(run: Session) -> float:
    gnorm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    if hasattr(gnorm, "full_tensor"):
        gnorm = gnorm.full_tensor()
    return float(gnorm)


def _apply_update(run: Session, progress: Progress, step_loss: float, gnorm: float, forward_error: str | None, log_f) -> bool:
    """Steps the optimizer; a non-finite loss or gradient norm skips the update (``skip``: returns
    True) or ends the run (``stop``: :class:`NonFiniteLossError`, logged first)."""
    if math.isfinite(step_loss) and math.isfinite(gnorm):
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        return False
    run.optimizer.zero_grad(set_to_none=True)
    if run.cfg.on_nonfinite != "stop":
        return True
    step = progress.step + 1
    last_good = progress.last_good
    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
    msg = (
        f"non-finite {'loss' if not math.isfinite(step_loss) else 'gradient norm'} at step "
        f"{step} (loss {step_loss}, grad norm {gnorm}"
        + (f"; in the forward: {forward_error}" if forward_error else "")
        + f"); the update was not applied and the run stopped; {where}. Lower --lr, or pass "
        "--on-nonfinite skip to skip such batches."
    )
    if log_f:
        log_f.write(json.dumps(dict(step=step, loss=step_loss, grad_norm=gnorm, error="non-finite")) + "\n")
        log_f.flush()
    raise NonFiniteLossError(msg)
