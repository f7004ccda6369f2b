"""A server's CPU threads do not depend on its slot count: each fresh process (a user's ``efla serve
--max-batch N``) serves one request and reports how many threads it holds. With 2 slots the state
pool was too small for its zero-fill to be split across threads, so the main thread had no OpenMP
team and the scheduler's team was the process's only one; libgomp then spins its idle workers,
which on a busy CPU made every decoding step 15-100x slower than with 16 slots or more."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SERVE_ONE_REQUEST = """
import os, sys, threading
import torch
from efla.models import EFLAForCausalLM, get_preset_config
from efla.serving import ErrorEvent, FinishEvent, SamplingParams, Scheduler

model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
scheduler = Scheduler(model, None, max_batch=int(sys.argv[1]), max_context=64)
scheduler.start()
ended = threading.Event()
on_event = lambda request, event: isinstance(event, (FinishEvent, ErrorEvent)) and ended.set()
scheduler.submit([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), on_event)
assert ended.wait(120)
print(len(os.listdir("/proc/self/task")))
scheduler.close(30)
"""


def threads_serving(max_batch: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", SERVE_ONE_REQUEST, str(max_batch)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.skipif(
    torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info(),
    reason="OpenMP teams exist only with several intra-op threads",
)
def test_a_server_holds_the_same_threads_whatever_its_slots():
    assert threads_serving(2) == threads_serving(64)
