"""Every argument ``EFLAForCausalLM.forward`` accepts changes its output or is refused."""

import pytest
import torch

from efla.models import EFLAForCausalLM
from efla.models.presets import get_preset_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config("tiny-efla")).double().eval()


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 9))


def test_output_attentions_is_refused(model, ids):
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions"):
        model.model(ids, output_attentions=True)
    assert model(ids, output_attentions=False).logits.shape == (2, 9, model.config.vocab_size)


def test_return_dict_false_gives_the_same_tensors_as_a_tuple(model, ids):
    full = model(ids, labels=ids, output_hidden_states=True, use_cache=False)
    loss, logits, hidden = model(ids, labels=ids, output_hidden_states=True, use_cache=False, return_dict=False)
    assert torch.equal(loss, full.loss) and torch.equal(logits, full.logits)
    assert all(torch.equal(a, b) for a, b in zip(hidden, full.hidden_states))


def test_inputs_embeds_equal_input_ids(model, ids):
    embeds = model.get_input_embeddings()(ids)
    assert (model(inputs_embeds=embeds).logits - model(ids).logits).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=embeds)


def test_logits_to_keep_keeps_the_last_positions(model, ids):
    full = model(ids).logits
    assert (model(ids, logits_to_keep=3).logits - full[:, -3:]).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)


def test_output_hidden_states_one_per_layer_plus_the_final_norm(model, ids):
    out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert model(ids).hidden_states is None


def test_unknown_arguments_are_refused_not_dropped(model, ids):
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=torch.arange(9).expand(2, 9))
    with pytest.raises(ValueError, match="position_ids"):
        model.model(ids, position_ids=torch.arange(9).expand(2, 9))
    assert model(ids, cache_position=torch.arange(9)).logits.shape == (2, 9, model.config.vocab_size)
