"""Whether the Triton CPU interpreter can run the GPU kernels here (the test extra installs Triton
and fla on Linux x86-64, so CI runs them)."""

import importlib.util


def interpreter_ready(packages=("triton", "fla")) -> tuple[bool, str]:
    """``(True, "")``, or ``(False, why)`` for a skip reason."""
    for pkg in packages:
        if importlib.util.find_spec(pkg) is None:
            return False, f"{pkg} not installed (the test extra installs it on Linux x86-64)"
    import numpy as np
    import triton

    if _version(np.__version__) >= (2, 3) and _version(triton.__version__) < (3, 7):
        why = f"Triton {triton.__version__}'s interpreter fails with NumPy {np.__version__}"
        return False, why + " (needs NumPy < 2.3, or Triton >= 3.7)"
    return True, ""


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
