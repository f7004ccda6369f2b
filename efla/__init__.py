"""efla: Exact Flow Linear Attention for PyTorch."""

__version__ = "0.1.0"

from . import ops  # noqa: F401
