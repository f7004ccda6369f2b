"""``efla.ops.cuda.experimental`` stays off the default path: with every experimental switch off,
importing every module of the GPU path and running its chunk ops (forward and backward, dense and
packed) and its scan imports nothing from it; a switch turned on imports its module; and the fused
forward refuses the split state rather than leave the backward alone split. Under Triton's CPU
interpreter, in a fresh process (an earlier test may have imported the experiments)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.interpreter import interpreter_ready

REPO = Path(__file__).resolve().parents[2]
_OK, _WHY = interpreter_ready()

_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys, torch
    sys.path.insert(0, {repo!r})
    from tests.layers import fused_checks
    fused_checks.prepare_interpreter()
    import efla
    from efla import environment
    from efla.ops import cuda

    def experiments():
        return sorted(name for name in sys.modules if name.startswith("efla.ops.cuda.experimental"))

    assert not any(environment.get(name) for name, v in environment.VARIABLES.items() if v.experimental)
    modules = [m.name for m in pkgutil.iter_modules(cuda.__path__) if m.name != "experimental"]
    assert {{"chunk", "stages", "launch", "custom_ops", "kernels", "recurrent"}} <= set(modules), modules
    for name in modules:
        importlib.import_module("efla.ops.cuda." + name)
    from efla.ops.cuda import custom_ops as C
    from efla.ops.cuda.recurrent import recurrent_forward

    def fwd_bwd(kind, cu=None):
        g = torch.Generator().manual_seed(0)
        B, T, H, K, V = 1, 128, 1, 16, 16
        leaves = [torch.randn(B, T, H, D, generator=g).requires_grad_() for D in (K, K, V)]
        leaves += [torch.rand(B, T, H, generator=g).requires_grad_(), (-torch.rand(B, T, H, generator=g)).requires_grad_()]
        q, k, v, beta, lg = leaves
        o, ht = C.chunk_forward(kind, q, k, v, lg if kind == "gated_efla" else None, beta, K**-0.5, None, True,
                                cu, True, False)
        (o.sum() + ht.sum()).backward()
        return [o, ht] + [x.grad for x in leaves if x.grad is not None]

    dense = {{kind: fwd_bwd(kind) for kind in ("efla", "gated_efla")}}
    fwd_bwd("efla", cu=torch.tensor([0, 50, 128]))
    x = torch.randn(1, 3, 1, 16)
    recurrent_forward("efla", x, x, x, None, torch.rand(1, 3, 1), 0.3, None, True, None)
    assert experiments() == [], experiments()

    with environment.override(EFLA_SPLIT_STATE=2):  # a switch on: its module, and only then
        split = fwd_bwd("efla")
    assert experiments() == ["efla.ops.cuda.experimental", "efla.ops.cuda.experimental.split_state"], experiments()
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(split, dense["efla"]))

    with environment.override(EFLA_FUSED_FORWARD=True, EFLA_SPLIT_STATE=2):
        try:
            fwd_bwd("gated_efla")
            raise AssertionError("the fused forward ran with the split state")
        except ValueError as e:
            assert str(e).startswith("EFLA_FUSED_FORWARD=1 and EFLA_SPLIT_STATE=2 cannot be combined"), e
    print("OK")
    """
)


@pytest.mark.skipif(not _OK, reason=_WHY)
def test_the_default_path_never_imports_the_experiments_under_triton_interpreter():
    env = {name: value for name, value in os.environ.items() if not name.startswith("EFLA_")}
    env["TRITON_INTERPRET"] = "1"
    script = _SCRIPT.format(repo=str(REPO))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
