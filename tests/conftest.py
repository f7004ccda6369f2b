import contextlib
import os

import pytest
import torch

from efla import environment


@pytest.fixture(autouse=True)
def _single_thread():
    """The suite runs many tiny ops; with a busy 2-core machine, intra-op threads spin and wait
    (measured: 107 s with 2 threads vs 13 s with 1 for tests/layers + tests/models)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _environment_read_afresh():
    """efla keeps each environment variable as first read: every test starts from the environment
    as it is (a ``monkeypatch.setenv`` before the variable's first read in the test counts; within a
    test, switch values with ``environment.override`` or the ``switches`` fixture)."""
    environment.reload()


@pytest.fixture
def switches():
    """``switches(EFLA_X=value, ...)``: ``efla.environment.override`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(environment.override(**values))


def pytest_addoption(parser):
    parser.addoption(
        "--serve-fuzz-examples",
        type=int,
        default=12,
        help="requests per route and mode of tests/serving/test_fuzz.py (default: %(default)s, a CI-size run; "
        "a nightly run: 2000)",
    )


def pytest_configure(config):
    """``EFLA_TEST_FIRST_CONFIG=1``: every autotuned Triton kernel runs its first launch setting
    without benchmarking the others. The GPU tests check results, which every setting must get
    right, and autotuning each new head dim, head count and kernel costs minutes per case on a fresh
    machine. (Timings must not share this process's Triton cache: give it its own TRITON_CACHE_DIR.)
    A switch of the test suite's, not efla's: spelled as efla's switches are (``efla.environment``)."""
    if environment.parse_switch("EFLA_TEST_FIRST_CONFIG", os.environ.get("EFLA_TEST_FIRST_CONFIG", "")):
        try:
            import triton.runtime.autotuner as autotuner
        except ImportError:
            return
        autotuner.Autotuner._bench = lambda self, *args, **kwargs: [1.0, 1.0, 1.0]
