"""The GPU path on Triton and flash-linear-attention releases it was not tested with
(``efla.ops.cuda.supported``): the direct launcher stands down, the chunk ops run fla's public
functions, and a failed import is named.

* CPU: each gate with the version it reads faked: its verdict, its one warning, the path it picks,
  and the failing import's error where the import fails.
* Triton interpreter (a subprocess; TRITON_INTERPRET=1 must be set before Triton compiles anything):
  the public-function path's outputs and gradients, every rule, against the float64 reference
  ``efla.ops.naive``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from tests.interpreter import interpreter_ready

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def supported(monkeypatch):
    """``efla.ops.cuda.supported`` with no verdict taken yet (each gate decides and warns afresh)."""
    from efla.ops.cuda import supported

    monkeypatch.setattr(supported, "_verdicts", {})
    return supported


def _fake_version(monkeypatch, module: str, version: str) -> None:
    monkeypatch.setattr(pytest.importorskip(module), "__version__", version)


def _verdict_and_warnings(gate) -> tuple[bool, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = gate()
        again = gate()
    assert again is verdict
    return verdict, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# ----------------------------------------------------------------------------- Triton: the direct launcher
@pytest.mark.parametrize(
    "version,tested",
    [
        ("3.6.0", True),
        ("3.6.1+cu130", True),
        ("3.8.0", True),
        ("3.7.1", False),
        ("3.9.0", False),
        ("3.60.0", False),
        ("4.0", False),
    ],
)
def test_direct_launcher_is_tested_on_triton_major_minor_only(supported, monkeypatch, version, tested):
    _fake_version(monkeypatch, "triton", version)
    verdict, messages = _verdict_and_warnings(supported.direct_launcher_tested)
    assert verdict is tested
    if tested:
        assert messages == []
    else:  # once, however often the gate is asked
        assert messages == [
            f"efla: Triton {version} is not a version the direct launcher was tested with (3.6, 3.8); launching through Triton"
        ]


class _Replayed(Exception):
    """Raised where a launch reaches the direct launcher's own path."""


class _Kernel:
    """``kernel[grid](**args)`` that notes its calls, as Triton's launch would run them."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **args: self.calls.append((grid, args)) or "through Triton"


@pytest.mark.parametrize("version,direct", [("3.6.0", True), ("3.9.0", False)])
def test_launch_goes_through_triton_on_an_untested_triton(supported, monkeypatch, version, direct):
    _fake_version(monkeypatch, "triton", version)
    from efla.ops.cuda import launch as L

    monkeypatch.setattr(L, "direct_launches", lambda: True)

    def replayed(*_):
        raise _Replayed

    monkeypatch.setattr(L, "_specialisation", replayed)
    kernel = _Kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if direct:  # the control: on a tested Triton the launch takes the direct launcher's path
            with pytest.raises(_Replayed):
                L.launch(kernel, (3,), x=1)
            return
        assert L.launch(kernel, (3,), x=1) == "through Triton"
    assert kernel.calls == [((3,), {"x": 1})]


# ----------------------------------------------------------------------------- fla: the chunk stages
@pytest.mark.parametrize(
    "version,tested", [("0.6.0", True), ("0.6.0+local", True), ("0.6.1", False), ("0.7.0", False), ("0.60.0", False)]
)
def test_fla_stages_are_tested_on_the_whole_release_only(supported, monkeypatch, version, tested):
    _fake_version(monkeypatch, "fla", version)
    verdict, messages = _verdict_and_warnings(supported.fla_stages_tested)
    assert verdict is tested
    if tested:
        assert messages == []
    else:
        assert messages == [
            f"efla: flash-linear-attention {version} is not a version efla's calls into its private chunk stages was "
            "tested with (0.6.0); running fla's public chunk_delta_rule / chunk_gated_delta_rule with efla's coefficients"
        ]


@pytest.fixture
def backend(supported, monkeypatch):
    """``efla.ops.cuda`` with nothing of fla loaded yet."""
    pytest.importorskip("triton")
    from efla.ops import cuda
    from efla.ops.cuda import chunk, public_chunk

    for module, name in ((cuda, "_fla_ok"), (cuda, "_fla_error"), (chunk, "FLA"), (public_chunk, "FLA")):
        monkeypatch.setattr(module, name, None)
    return cuda


@pytest.mark.parametrize("version,stages", [("0.6.0", True), ("0.7.0", False)])
def test_chunk_path_takes_fla_public_functions_on_an_untested_fla(backend, monkeypatch, version, stages):
    from efla.ops.cuda import chunk, custom_ops, public_chunk

    _fake_version(monkeypatch, "fla", version)

    def load_stages():
        raise RuntimeError("the stage kernels were loaded")

    monkeypatch.setattr(chunk, "load", load_stages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        available = backend.fla_available()
        path = backend._chunk_path()
    if stages:  # the control: the tested release loads the stage kernels (here: fails, and says so)
        assert not available and backend.fla_import_error() == "RuntimeError: the stage kernels were loaded"
        assert path is custom_ops.chunk_forward
    else:
        assert available and backend.fla_import_error() is None
        assert path is public_chunk.chunk_forward
        assert set(public_chunk.FLA) == {"delta_rule", "gated_delta_rule"}


@pytest.mark.parametrize(
    "version,blocked",
    [("0.6.0", "fla"), ("0.6.0", "fla.ops.utils.index"), ("0.7.0", "fla.ops.gated_delta_rule")],
)
def test_a_failed_import_is_named_with_its_error(backend, monkeypatch, version, blocked):
    _fake_version(monkeypatch, "fla", version)
    monkeypatch.setitem(sys.modules, blocked, None)  # its import raises ModuleNotFoundError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not backend.fla_available()
    assert backend.fla_import_error() == f"ModuleNotFoundError: import of {blocked} halted; None in sys.modules"


# ----------------------------------------------------------------------------- Triton interpreter
_READY, _WHY = interpreter_ready()

# fla's chunk_delta_rule takes no float32 and the interpreter's bf16 products are wrong, so the
# float32 checks run its call, held to its signature and dtype rules, as fla's gated delta rule with
# a zero gate; a bf16 call of the real function checks that it takes what the path hands it.
_SCRIPT = textwrap.dedent(
    """
    import inspect
    import torch
    import torch.nn.functional as F
    import fla
    from tests.layers.fused_checks import prepare_interpreter

    prepare_interpreter()
    fla.__version__ = "0.7.0"  # a release whose stage kernels efla was not tested with
    from efla.ops import naive
    from efla.ops.cuda import _chunk_path, public_chunk
    from efla.ops.gates import RawGates, activate

    chunk_forward = _chunk_path()
    assert chunk_forward is public_chunk.chunk_forward, chunk_forward
    functions = public_chunk.load()
    real_delta_rule = functions["delta_rule"]
    named = {n for n, p in inspect.signature(real_delta_rule).parameters.items() if p.kind is not p.VAR_KEYWORD}

    def delta_rule_in_float32(q, k, v, beta, **kwargs):
        assert set(kwargs) <= named, set(kwargs) - named
        assert q.dtype == k.dtype == v.dtype and beta.dim() == 3
        return functions["gated_delta_rule"](q, k, v, torch.zeros(beta.shape), beta, **kwargs)

    functions["delta_rule"] = delta_rule_in_float32
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 70, 2, 16, 16
    SCALE = K ** -0.5
    NAMES = ["o", "S", "q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"]

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    def inputs(rule, varlen):
        q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
        k = torch.randn(B, T, H, K, generator=gen)
        if rule.endswith("efla"):  # raw keys, ||k||^2 from about 0.2 to 1600
            k = k * 10 ** (2 * torch.rand(B, T, H, 1, generator=gen) - 1)
        else:
            k = F.normalize(k, dim=-1)
        beta, g = torch.rand(B, T, H, generator=gen), F.logsigmoid(2 + 3 * torch.randn(B, T, H, generator=gen))
        g[0, 5, 1] = -100.0  # e^g below the kernels' floor: 1 / e^g would overflow the rescaled value
        xs = [q, k, v, g, beta]
        if varlen:
            xs = [x.reshape(1, B * T, *x.shape[2:]) for x in xs]
        return xs + [torch.randn(B, H, K, V, generator=gen)]

    def run(fn, xs, dtype, weights):
        leaves = [x.to(dtype).clone().requires_grad_() for x in xs]
        o, S = fn(*leaves)
        ((o.double() * weights[0]).sum() + (S.double() * weights[1]).sum()).backward()
        return [o, S] + [x.grad for x in leaves]

    def check(name, ours, reference, xs):
        weights = [torch.randn(*x.shape, generator=gen).double() for x in (xs[2], xs[5])]
        got, want = run(ours, xs, torch.float32, weights), run(reference, xs, torch.float64, weights)
        for part, a, b in zip(NAMES, got, want):
            if b is not None:
                print(f"{name} {part}", f"{rel(a, b):.3e}", sep="\\t")

    def naive_op(rule, cu, q_l2, k_l2):
        norms = dict(use_q_l2norm_in_kernel=q_l2, use_qk_l2norm_in_kernel=k_l2)
        state = dict(scale=SCALE, output_final_state=True, cu_seqlens=cu, **norms)
        if rule.startswith("gated"):
            return lambda q, k, v, g, beta, h0: getattr(naive, rule)(q, k, v, g, beta, initial_state=h0, **state)
        return lambda q, k, v, g, beta, h0: getattr(naive, rule)(q, k, v, beta, initial_state=h0, **state)

    for rule in ("efla", "gated_efla", "delta_rule", "gated_delta_rule"):
        gated = rule.startswith("gated")
        for varlen, q_l2, k_l2 in ((False, False, False), (True, True, False), (False, True, True)):
            cu = torch.tensor([0, 37, 2 * T]) if varlen else None

            def ours(q, k, v, g, beta, h0):
                return chunk_forward(rule, q, k, v, g if gated else None, beta, SCALE, h0, True, cu, q_l2, k_l2)

            name = f"{rule} varlen={varlen} q_l2norm={q_l2} k_l2norm={k_l2}"
            check(name, ours, naive_op(rule, cu, q_l2, k_l2), inputs(rule, varlen))

    # Gated EFLA with raw gates: activated in PyTorch, then the same path
    raw_a, raw_b = torch.randn(B, T, H, generator=gen), torch.randn(B, T, H, generator=gen)
    params = [torch.randn(H, generator=gen), torch.randn(H, generator=gen)]
    q, k, v, _, _, h0 = inputs("gated_efla", False)

    def ours_raw(q, k, v, a, b, h0, A_log, dt_bias):
        return chunk_forward("gated_efla", q, k, v, a, b, SCALE, h0, True, None, True, False, RawGates(A_log, dt_bias, 2.0))

    def reference_raw(q, k, v, a, b, h0, A_log, dt_bias):
        g, beta = activate(a, b, RawGates(A_log, dt_bias, 2.0))
        return naive_op("gated_efla", None, True, False)(q, k, v, g, beta, h0)

    check("gated_efla raw gates", ours_raw, reference_raw, [q, k, v, raw_a, raw_b, h0, *params])

    # the real chunk_delta_rule takes the bf16 call, forward and backward (values not checked: see above)
    functions["delta_rule"] = real_delta_rule
    leaves = [x[:1, :64].bfloat16().requires_grad_() for x in (q, k, v)] + [torch.rand(1, 64, H).bfloat16().requires_grad_()]
    o, _ = chunk_forward("efla", *leaves[:3], None, leaves[3], SCALE, None, False, None, True, False)
    o.float().sum().backward()
    assert o.dtype == torch.bfloat16 and o.shape == leaves[2].shape
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in leaves)
    print("bf16 call OK")
    """
)


@pytest.mark.skipif(not _READY, reason=_WHY)
def test_public_function_path_matches_the_float64_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "bf16 call OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    errors = [line.split("\t") for line in r.stdout.strip().splitlines() if "\t" in line]
    # per rule and case: o, S and the grads of q, k, v, beta, h0 (and g where gated); raw gates add A_log, dt_bias
    assert len(errors) == 3 * (7 + 8 + 7 + 8) + 10, r.stdout
    for name, err in errors:
        assert float(err) < 1e-4, (name, err)


def test_an_experimental_switch_on_the_public_path_is_said_to_do_nothing(backend, monkeypatch):
    """The experimental switches change efla's stage path only: on fla's public functions each one set
    is named once in a warning, not silently ignored."""
    from efla import environment
    from efla.ops.cuda import public_chunk

    calls = []
    monkeypatch.setattr(public_chunk, "FLA", {"delta_rule": lambda *a, **kw: calls.append(kw) or (a[0], None)})
    monkeypatch.setattr(public_chunk, "_warned", set())
    q = torch.randn(1, 8, 2, 4)
    args = ("delta_rule", q, q, q, None, torch.rand(1, 8, 2), None, None, False, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        public_chunk.chunk_forward(*args)
        with environment.override(EFLA_STATE_TUNING=True, EFLA_SPLIT_STATE=4):
            public_chunk.chunk_forward(*args)
            public_chunk.chunk_forward(*args)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "EFLA_SPLIT_STATE, EFLA_STATE_TUNING" in said[0] and "no effect" in said[0]
    assert len(calls) == 3
