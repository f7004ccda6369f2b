"""The GPU chunk paths as custom ops (``efla.ops.cuda.custom_ops``), on the CPU under Triton's
interpreter: ``torch.library.opcheck`` of every forward and backward op, the custom ops against the
eager autograd Functions (outputs and gradients), and ``torch.compile(fullgraph=True)`` through them.

Runs ``tests/ops/custom_op_checks.py`` in a subprocess (TRITON_INTERPRET=1 must be set before
Triton compiles anything); skips where Triton or flash-linear-attention is not installed (CI
installs neither) or NumPy is too new for Triton's interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from . import custom_op_checks
from tests.interpreter import interpreter_ready

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_READY, _WHY = interpreter_ready()

# per kind and input case: 2 opchecks (float32, bfloat16) and the comparison with the float64
# reference, and for each kind but DeltaNet (whose eager path is fla's own function) the comparison
# with the autograd Function; per kind: a backward opcheck and a compiled comparison
_CASES = len(custom_op_checks.CASES)
_RULES = len(custom_op_checks.RULES)
_EXPECTED_LINES = _RULES * (_CASES * 3 + 2) + (_RULES - 1) * _CASES + 1


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "tests.ops.custom_op_checks"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = dict(line.split("\t") for line in r.stdout.strip().splitlines() if "\t" in line)
    assert len(lines) == _EXPECTED_LINES, r.stdout
    return lines


def _with_prefix(results, prefix):
    found = {name: value for name, value in results.items() if name.startswith(prefix)}
    assert found, prefix
    return found


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_opcheck_passes_for_every_op(results):
    # each line is printed only after its opcheck returned; an opcheck failure exits non-zero
    assert len(_with_prefix(results, "opcheck forward")) == len(custom_op_checks.RULES) * _CASES * 2
    assert len(_with_prefix(results, "opcheck backward")) == len(custom_op_checks.RULES)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_custom_ops_match_the_autograd_functions(results):
    for name, err in _with_prefix(results, "custom op vs eager").items():
        assert float(err) < 1e-6, (name, err)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_deltanet_custom_op_matches_the_float64_scan(results):
    for name, err in _with_prefix(results, "custom op vs float64 reference").items():
        assert float(err) < 1e-4, (name, err)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_compiled_chunk_forward_matches_eager_without_recompiling(results):
    for name, err in _with_prefix(results, "compiled vs eager").items():
        assert float(err) < 1e-6, (name, err)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_gated_backward_stage_agrees_at_every_launch_setting(results):
    (err,) = _with_prefix(results, "dqkwg launch settings agree").values()
    assert float(err) < 1e-5, err
