"""Whether the Triton CPU interpreter can run the GPU kernels here (the GPU extra is not in CI)."""

import importlib.util


def interpreter_ready(packages=("triton", "fla")) -> tuple[bool, str]:
    """``(True, "")``, or ``(False, why)`` for a skip reason."""
    for pkg in packages:
        if importlib.util.find_spec(pkg) is None:
            return False, f"{pkg} not installed (GPU extra; CI does not install it)"
    import numpy as np

    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3):
        return False, f"Triton's interpreter fails with NumPy {np.__version__} (needs < 2.3)"
    return True, ""
