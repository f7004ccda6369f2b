"""``benchmarks/gpu_model.py``'s ``+graph`` kind (the whole training step replayed from a CUDA graph):
its options and error lines on the CPU; on a GPU, the replayed steps' losses against the eager steps'
from the same weights and tokens."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_model():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_model

        yield gpu_model
    finally:
        sys.path.remove(str(BENCHMARKS))


def _main(gpu_model, monkeypatch, tmp_path, *args):
    monkeypatch.setattr(sys, "argv", ["gpu_model.py", "--out", str(tmp_path), *args])
    return gpu_model.main()


@pytest.mark.skipif(CUDA, reason="checks the message of a machine without CUDA")
def test_without_cuda_a_graph_kind_gets_the_one_line_answer(gpu_model, monkeypatch, tmp_path, capsys):
    assert _main(gpu_model, monkeypatch, tmp_path, "--models", "fla,efla,efla+graph,efla+triton") == 0
    assert capsys.readouterr().out == "no CUDA device: nothing to do\n"


def test_a_graph_kind_needs_warm_up_steps_past_its_eager_steps_and_recording(gpu_model, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        _main(gpu_model, monkeypatch, tmp_path, "--models", "efla,efla+graph", "--warmup", "2")
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    expected = "--warmup 2: a +graph model needs at least 3 warm-up steps (2 eager, then the one that records its graph)"
    assert last.endswith(expected)
    gpu_model.check_graph_kinds(["efla", "efla+triton"], 0)  # eager kinds need none
    gpu_model.check_graph_kinds(["efla+graph"], 3)


@pytest.mark.parametrize("kind", ["efla+split4+graph", "efla+flce+graph", "efla+nokeycheck+graph"])
def test_a_graph_kind_with_a_suffix_its_recording_would_drop_is_refused(gpu_model, kind):
    with pytest.raises(ValueError, match=rf"--models: {re.escape(kind)} cannot be recorded as a graph"):
        gpu_model.check_graph_kinds(["efla", kind], 5)
    gpu_model.check_graph_kinds(["efla+split4", "efla+flce", "efla+graph+triton"], 5)


def test_only_graph_kinds_step_through_a_graph(gpu_model):
    model, opt = torch.nn.Linear(2, 2), None
    assert isinstance(gpu_model.stepper("efla+graph", model, opt), gpu_model.GraphedSteps)
    assert isinstance(gpu_model.stepper("efla+graph+triton", model, opt), gpu_model.GraphedSteps)
    eager = gpu_model.stepper("efla+triton", model, opt)
    assert eager.func is gpu_model.train_step and eager.args == (model, opt)


def test_graphed_steps_record_once_per_shape_after_its_eager_steps(gpu_model, monkeypatch):
    # the order of a +graph kind's steps, its CUDA parts stood in for: eager steps, the recording,
    # replays; a new shape releases the graph (and the gradients in its memory) and starts over
    log = []
    model = torch.nn.Linear(2, 2)
    step = gpu_model.GraphedSteps(model, torch.optim.SGD(model.parameters()))

    def record(ids):
        log.append("record")
        step.graph, step.loss, step.peak = object(), torch.tensor(2.0), 7

    monkeypatch.setattr(step, "eager_step", lambda ids: log.append("eager") or (1.0, 5, 0.5))
    monkeypatch.setattr(step, "record", record)
    monkeypatch.setattr(step, "replay", lambda ids: log.append("replay"))
    monkeypatch.setattr(gpu_model, "measured", lambda run: (0.25, 0, run()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model.weight.grad = torch.ones(2, 2)
    results = [step(torch.zeros(shape)) for shape in [(2, 4)] * 4 + [(1, 8)] * 4]
    assert log == ["eager", "eager", "record", "replay", "replay"] + ["eager", "eager", "record", "replay", "replay"]
    assert results[:4] == [(1.0, 5, 0.5), (1.0, 5, 0.5), (0.25, 7, 2.0), (0.25, 7, 2.0)]
    assert model.weight.grad is None  # dropped with the first shape's graph
    step.release()
    assert step.graph is None and step.shape is None


def _raised_while_handling(first: str, second: str) -> BaseException:
    try:
        try:
            raise RuntimeError(first)
        except RuntimeError:
            raise RuntimeError(second)  # noqa: B904  the implicit chaining is what is under test
    except RuntimeError as e:
        return e


def test_a_failed_recording_row_names_the_error_inside_the_capture(gpu_model):
    # torch.cuda.graph's exit raises about the invalidated capture while the step's error propagates
    e = _raised_while_handling("operation not permitted when stream is capturing\ndetails", "CUDA error: capture invalidated")
    assert gpu_model.error_line(e) == "RuntimeError: operation not permitted when stream is capturing"
    try:
        raise ValueError("a | b") from None
    except ValueError as suppressed:
        assert gpu_model.error_line(suppressed) == "ValueError: a / b"
    try:
        raise RuntimeError("compile failed") from KeyError("inner")
    except RuntimeError as wrapped:
        assert gpu_model.error_line(wrapped) == "KeyError: 'inner'"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_graphed_steps_give_the_eager_steps_losses(gpu_model, dtype, rtol):
    # two shapes, so the graph is recorded, released and recorded again; tokens the model learns fast
    # (8 of them, another 8 every other step) at a large lr, so a replay that skipped the update or
    # read stale tokens would move the losses far more than the tolerance
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(2, 64)] * 6 + [(1, 128)] * 5
    batches = [torch.randint(0, 8, shape, device="cuda", generator=gen) + 8 * (i % 2) for i, shape in enumerate(shapes)]
    losses = {}
    for kind in ("efla", "efla+graph"):
        model, opt = gpu_model.build(kind, "tiny")
        model.to(dtype)  # the optimizer keeps the same parameters and has no state yet
        for group in opt.param_groups:
            group["lr"] = 1e-2
        step = gpu_model.stepper(kind, model, opt)
        losses[kind] = [step(ids)[2] for ids in batches]
        if kind.endswith("+graph"):
            assert step.graph is not None and step.shape == (1, 128)  # the last steps were replays
            step.release()
    eager, graphed = losses["efla"], losses["efla+graph"]
    assert max(eager) - min(eager) > 20 * rtol * max(eager)
    assert graphed == pytest.approx(eager, rel=rtol)
