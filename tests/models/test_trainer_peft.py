"""transformers' Trainer and PEFT LoRA train EFLAForCausalLM on the CPU."""

import pytest
import torch

from efla.models import EFLAForCausalLM
from efla.models.presets import get_preset_config

pytest.importorskip("accelerate", reason="Trainer needs accelerate (pip install 'efla[peft]')")


class _RepeatedSequences(torch.utils.data.Dataset):
    """A few short token sequences, learnable in a handful of steps."""

    def __init__(self, n: int = 16, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 256, (4, length), generator=g).repeat(n // 4, 1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _train(model, tmp_path, learning_rate=3e-3, **args):
    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=learning_rate,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **args,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=_RepeatedSequences())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _tiny_model():
    torch.manual_seed(0)
    return EFLAForCausalLM(get_preset_config("tiny-efla"))


def _checkpointing():
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": True}


def test_trainer_with_gradient_checkpointing_lowers_the_loss(tmp_path):
    model = _tiny_model()
    losses = _train(model, tmp_path, **_checkpointing())
    assert model.model.gradient_checkpointing
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses


def test_trainer_with_bf16_autocast_lowers_the_loss(tmp_path):
    losses = _train(_tiny_model(), tmp_path, bf16=True, **_checkpointing())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses


def test_peft_lora_wraps_the_projections_and_trains(tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install 'efla[peft]')")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(_tiny_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(targets)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = _train(model, tmp_path, learning_rate=3e-2)  # LoRA starts at zero: it needs a larger step
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
