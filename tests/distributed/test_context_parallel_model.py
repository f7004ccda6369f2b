"""A causal LM whose sequences are split over ranks: the same loss and parameter gradients as one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from efla.distributed import context_parallel_lm_loss, next_token_targets, setup_context_parallel
from efla.models import EFLAForCausalLM
from efla.models.presets import get_preset_config

from .layer_hook import token_mixers_routed
from .spawn import run_in_processes

PRESETS = ["tiny-efla", "tiny-gated-efla", "tiny-deltanet", "tiny-gated-deltanet", "tiny-gated-efla/grouped-values"]
OVERRIDES = {"grouped-values": dict(num_v_heads=4)}  # 4 value heads on the presets' 2 query/key heads
DOCUMENTS = (0, 5, 29, 40)  # the middle document spans every part with 2 and 4 ranks
# float64 model, but its norms, the gate and the norms' weight gradients are computed in float32 (as
# in flash-linear-attention), and the split sums those gradients in another order: float32 rounding
LOSS_TOL, GRAD_TOL = 1e-8, 1e-7


def _model(preset: str) -> EFLAForCausalLM:
    """``preset`` or ``preset/override`` (see ``OVERRIDES``)."""
    name, _, override = preset.partition("/")
    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config(name, vocab_size=50, **OVERRIDES.get(override, {}))).double()


def _batches() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {
        "batch": dict(input_ids=torch.randint(3, 50, (2, 24), generator=gen)),
        "varlen": dict(
            input_ids=torch.randint(3, 50, (1, 40), generator=gen), cu_seqlens=torch.tensor(DOCUMENTS, dtype=torch.int32)
        ),
    }


def _mean_loss(logits, batch) -> torch.Tensor:
    """The model's loss in float64 (its own ``loss`` is float32)."""
    target = next_token_targets(batch["input_ids"], batch.get("cu_seqlens"))
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def test_next_token_targets_give_the_model_loss():
    model = _model("tiny-efla").float()
    for batch in _batches().values():
        logits = model(**batch).logits
        expected = model.loss(logits, batch["input_ids"], batch.get("cu_seqlens"))
        torch.testing.assert_close(_mean_loss(logits, batch), expected, rtol=0, atol=1e-6)


def _reference(preset: str, batch: dict):
    model = _model(preset)
    loss = _mean_loss(model(**batch, use_cache=False).logits, batch)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _split(preset: str, batch: dict, cp):
    model = _model(preset)
    loss = context_parallel_lm_loss(model, batch, cp)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    return total, grads


def compare_models(rank: int, world: int) -> dict:
    cp = setup_context_parallel(world)
    errors = {}
    with token_mixers_routed():
        for preset in PRESETS:
            for name, batch in _batches().items():
                loss_ref, grads_ref = _reference(preset, batch)
                loss, grads = _split(preset, batch, cp)
                errors[f"{preset}/{name}"] = dict(
                    loss=float((loss - loss_ref).abs()),
                    grads=max(float((g - r).abs().max()) for g, r in zip(grads, grads_ref)),
                    grad_scale=max(float(r.abs().max()) for r in grads_ref),
                )
    return errors


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_split_model_matches_single_process(world, tmp_path):
    errors = run_in_processes(compare_models, world, tmp_path)[0]
    bad = {case: e for case, e in errors.items() if not (e["loss"] < LOSS_TOL and e["grads"] < GRAD_TOL)}
    assert not bad, f"errors above {LOSS_TOL} (loss) or {GRAD_TOL} (gradients): {bad}"
    assert min(e["grad_scale"] for e in errors.values()) > 1e-3  # the gradients compared are not all zero
    print(
        f"world {world}: max loss error {max(e['loss'] for e in errors.values()):.2e}, "
        f"max gradient error {max(e['grads'] for e in errors.values()):.2e}"
    )
