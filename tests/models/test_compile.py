"""``torch.compile(model)`` trains the tiny presets on the CPU: one graph for the whole forward and
backward (no graph breaks), no recompilation after the first step, and the losses of eager mode. On
a GPU (skipped elsewhere) it trains through the chunk custom ops under inductor.

The backend is ``aot_eager_decomp_partition`` (Dynamo, AOTAutograd with inductor's decompositions
and forward/backward partitioning, run by eager kernels) rather than inductor, whose
C++ code generation takes minutes on a 2-core CPU.
"""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from efla.models import EFLAForCausalLM, get_preset_config


def _train(model, forward, ids, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss = forward(ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", ["tiny-efla", "tiny-gated-efla"])
def test_compiled_model_trains_without_graph_breaks_or_recompiles(preset):
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config(preset)).train()
    compiled = torch.compile(model, backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
    losses = _train(model, compiled, ids)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch.manual_seed(0)
    eager_model = EFLAForCausalLM(get_preset_config(preset)).train()
    assert losses == pytest.approx(_train(eager_model, eager_model, ids), rel=1e-5)
    assert losses[-1] < losses[0]


def _lazy_loaders():
    import efla.ops.api as api
    from efla.layers import fla_kernels as fused
    from efla.ops import cuda

    return {
        "GPU backend": (api, "_cuda_backend", lambda: api._cuda() is not None),
        "fla for the GPU ops": (cuda, "_fla_ok", cuda.fla_available),
        "fla's fused modules": (fused, "_kernels", lambda: fused._load() is not None),
    }


@pytest.mark.parametrize("name", ["GPU backend", "fla for the GPU ops", "fla's fused modules"])
def test_lazy_import_inside_compiled_code_does_not_recompile(name, monkeypatch):
    # the first call of a compiled model can be the first to ask for the optional GPU stack; the
    # import's cached result must not become a guard that fails on the next call
    module, cache, available = _lazy_loaders()[name]
    monkeypatch.setattr(module, cache, None)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1 if available() else x - 1, backend="eager", fullgraph=True)
    first = compiled(torch.zeros(2))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(compiled(torch.zeros(2)), first)
    assert torch.equal(first, torch.full((2,), 1.0 if available() else -1.0))


def _recording_inductor(seen: set):
    """inductor, first recording the ops of every graph Dynamo hands it."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_fx(gm, example_inputs)

    return backend


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "preset,op",
    [
        ("tiny-efla", "efla.chunk_delta_fwd"),
        ("tiny-deltanet", "efla.chunk_delta_fwd"),
        ("tiny-gated-efla", "efla.chunk_gated_fwd"),
    ],
)
def test_compiled_model_trains_on_gpu_through_the_custom_ops(preset, op):
    from efla.ops import cuda as backend

    if not backend.fla_available():
        pytest.skip("flash-linear-attention not installed")
    torch._dynamo.reset()
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    torch.manual_seed(0)
    config = get_preset_config(preset, vocab_size=512, hidden_size=128, num_heads=2)
    model = EFLAForCausalLM(config).cuda().to(torch.bfloat16).train()
    eager_model = copy.deepcopy(model)
    seen = set()
    losses = _train(model, torch.compile(model, backend=_recording_inductor(seen), dynamic=False), ids)
    assert any(name.startswith(op) for name in seen), sorted(seen)
    assert losses == pytest.approx(_train(eager_model, eager_model, ids), rel=2e-2)
