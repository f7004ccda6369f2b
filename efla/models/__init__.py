"""transformers-native EFLA language models.

``EFLAConfig`` (``model_type = "efla"``), ``EFLAModel``, ``EFLAForCausalLM``, the generation cache
``EFLACache`` and named presets (``get_preset_config``, ``PRESETS``). Importing this package
registers the classes with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``.

Examples:
    >>> import torch
    >>> from efla.models import EFLAForCausalLM, get_preset_config
    >>> model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
    >>> ids = torch.randint(0, 256, (1, 8))
    >>> model.generate(ids, max_new_tokens=4, do_sample=False).shape
    torch.Size([1, 12])
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import EFLACache
from .configuration_efla import EFLAConfig
from .modeling_efla import EFLABlock, EFLAForCausalLM, EFLAModel, EFLAPreTrainedModel
from .presets import PRESETS, SIZES, VARIANTS, get_preset_config, preset_names

__all__ = [
    "EFLACache",
    "EFLAConfig",
    "EFLABlock",
    "EFLAModel",
    "EFLAForCausalLM",
    "EFLAPreTrainedModel",
    "PRESETS",
    "SIZES",
    "VARIANTS",
    "get_preset_config",
    "preset_names",
    "register_auto_classes",
]


def register_auto_classes() -> None:
    """Register ``EFLAConfig`` / ``EFLAModel`` / ``EFLAForCausalLM`` with the transformers Auto
    classes (idempotent; done on import)."""
    AutoConfig.register(EFLAConfig.model_type, EFLAConfig, exist_ok=True)
    AutoModel.register(EFLAConfig, EFLAModel, exist_ok=True)
    AutoModelForCausalLM.register(EFLAConfig, EFLAForCausalLM, exist_ok=True)


register_auto_classes()
