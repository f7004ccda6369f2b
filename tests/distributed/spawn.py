"""Run a function in N gloo processes with a deadline: no test can hang on a lost collective."""

from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


def _entry(rank: int, world: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        if dist.is_initialized():  # fn may have destroyed it, as a command does at its end
            dist.destroy_process_group()
    # a finished rank leaves without the interpreter's finalization, where gloo's threads are sometimes
    # destroyed still joinable ("terminate called without an active exception", SIGABRT) after the
    # result was written; a failing fn raised above and is reported as before
    os._exit(0)


def run_in_processes(fn, world: int, workdir, args=(), deadline_s: float = 240) -> list:
    """``fn(rank, world, *args)`` in ``world`` spawned processes joined in one gloo group; returns the
    per-rank results. ``fn`` must be importable (module level). Processes still running after
    ``deadline_s`` are killed and the call fails."""
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    context = mp.start_processes(_entry, args=(world, workdir, fn, args), nprocs=world, join=False, start_method="spawn")
    waited = 0.0
    try:
        while not context.join(timeout=5):
            waited += 5
            if waited >= deadline_s:
                raise TimeoutError(f"{world} processes still running after {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world):
        with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results
