"""efla: Exact Flow Linear Attention for PyTorch.

``import efla`` registers the ``efla`` model type with transformers' ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM``.
"""

__version__ = "0.1.0"

from . import layers, models, ops  # noqa: F401
