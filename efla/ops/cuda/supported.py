"""The Triton and flash-linear-attention releases that efla's use of their internals was tested with.

Two parts of the GPU path lean on what is not their owners' API:

* the direct launcher (``launch.py``) replays Triton's launcher through Triton's internals
  (``knobs``, the driver, ``Autotuner``, ``JITFunction``'s hooks and parameters, the compiled
  kernel's ``run``): it depends on Triton's release alone;
* the chunk path launches fla's private stage kernels with fla 0.6.0's arguments and tiles
  (``stages.py``): it depends on fla's release alone (the kernels are those fla's own functions
  launch, so a Triton that runs fla's functions runs these).

On any other release each stands down with one ``RuntimeWarning`` that says what was skipped and
why: launches go through Triton (``kernel[grid](...)``), and the chunk ops run fla's public
``chunk_delta_rule`` / ``chunk_gated_delta_rule`` with efla's coefficients (``public_chunk.py``).

Triton is compared on major.minor: its patch releases fix bugs without moving the internals the
launcher reads (``3.6.0+cu130`` counts as 3.6). fla on the whole release: it is before 1.0 and its
private kernels' parameters are no API, so any release may change them.
"""

from __future__ import annotations

import re
import warnings

import torch

# 3.6: on the H200, chunk ops replayed bit-equal to the same ops through Triton's launch; 3.8: in CI,
# Triton's own launch path with a stand-in driver (no GPU) passes the argument vectors the replay
# passes, for every stage (tests/ops/test_launch.py)
TESTED_TRITON = ("3.6", "3.8")
# the only release the stage functions were written against and the tests and benchmarks ran with
TESTED_FLA = ("0.6.0",)

_verdicts: dict[str, bool] = {}  # per seam, decided at its first use (one warning at most)


def triton_version() -> str:
    import triton  # noqa: PLC0415 (lazy: `import efla` must not need Triton)

    return str(triton.__version__)


def fla_version() -> str:
    import fla

    return str(getattr(fla, "__version__", "unknown"))


def major_minor(version: str) -> str:
    """``"3.6"`` for ``"3.6.0+cu130"``; the version as it is where it does not start so."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{found[1]}.{found[2]}" if found else version


def release(version: str) -> str:
    """The version without its local part: ``"0.6.0"`` for ``"0.6.0+local"``."""
    return version.split("+")[0]


def direct_launcher_tested() -> bool:
    """Whether this Triton is one the direct launcher was tested with; warns once where not."""
    verdict = _verdicts.get("launcher")
    if verdict is None:
        version = triton_version()
        seam, instead = "the direct launcher", "launching through Triton"
        verdict = _verdicts["launcher"] = _judge(f"Triton {version}", major_minor(version), TESTED_TRITON, seam, instead)
    return verdict


# evaluated once while tracing, like ``fla_available``: the dispatcher asks under torch.compile
@torch.compiler.assume_constant_result
def fla_stages_tested() -> bool:
    """Whether this fla is the release whose private chunk stages efla was tested with; warns once
    where not."""
    verdict = _verdicts.get("fla stages")
    if verdict is None:
        version = fla_version()
        seam = "efla's calls into its private chunk stages"
        instead = "running fla's public chunk_delta_rule / chunk_gated_delta_rule with efla's coefficients"
        installed = f"flash-linear-attention {version}"
        verdict = _verdicts["fla stages"] = _judge(installed, release(version), TESTED_FLA, seam, instead)
    return verdict


def _judge(installed: str, compared: str, tested: tuple[str, ...], seam: str, instead: str) -> bool:
    if compared in tested:
        return True
    message = f"efla: {installed} is not a version {seam} was tested with ({', '.join(tested)}); {instead}"
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return False
