"""The token mixers' fused decoding step (one kernel: convolutions, activations, gates, state update,
output norm) against their general code, on a slot pool: its PyTorch form on the CPU in float64 and
float32, the Triton kernel under Triton's CPU interpreter in float32 and on a GPU in float32 and
bfloat16 (see ``decode_checks.py``)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.interpreter import interpreter_ready
from tests.layers import decode_checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_READY, _WHY = interpreter_ready(("triton",))


@pytest.mark.parametrize("name", list(decode_checks.CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
@pytest.mark.parametrize("stiff", [False, True])
def test_decode_step_on_cpu(name, dtype, tol, stiff):
    errors = decode_checks.compare(name, device="cpu", dtype=dtype, stiff=stiff)
    assert max(errors) < tol, errors


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_fused_decode_step_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "tests.layers.decode_checks"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    errors = [line.split("\t") for line in r.stdout.strip().splitlines()]
    assert len(errors) >= 2 * 2 * len(decode_checks.CASES) * 2, r.stdout
    for *name, err in errors:
        assert float(err) < 1e-5, (name, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU fast path)")
@pytest.mark.parametrize("name", list(decode_checks.CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("stiff", [False, True])
@pytest.mark.parametrize("blocks", [1, 2])
def test_fused_decode_step_on_gpu(name, dtype, tol, stiff, blocks):
    errors = decode_checks.compare(name, device="cuda", dtype=dtype, stiff=stiff, blocks=blocks)
    assert max(errors) < tol, errors
