"""fla's sequential state passes, tuned per number of sequence-heads.

fla's autotuner keys its state-pass kernels (the forward ``h`` pass and the backward ``dh`` pass)
on the head count and head dims only, so the launch setting chosen at the first shape a process
(or Triton's disk cache) saw stays for every batch size and length after it. These kernels walk a
sequence's chunks one after another, one program per (sequence, head, value block): at
[8, 2K, 16] with K = V = 128 the grid holds 256 or 512 programs, at [1, 16K, 16] 32 or 64, fewer than
the H200's 132 multiprocessors, and the value block and warp count that are fastest differ between
the two. With ``EFLA_STATE_TUNING=1`` each power-of-two bucket of sequences x heads gets its own
Triton autotuner over fla's settings.

On a GPU: timed once on an H200 (2026-12-04, one round, ``docs/performance.md``), faster than
the default at the two 16K shapes (EFLA forward 0.84x and 0.90x) and slower at the two smallest
(forward and backward 1.19x at [8, 2K, 16], 1.09x at [4, 4K, 16], not explained). Its GPU test
(``tests/ops/test_tuning.py -m gpu``) has never passed: the H200 run of 2026-12-05 that included
it failed its first two tests (the split state's, in pytest's order) and was cut off at its limit
without a summary, so this one failed or never ran. Decided at the next GPU visit by
``PYTEST_K=tuning OPS_ARGS="--skip-decode --skip-model --skip-correctness --rounds 3 --variants tuned"
bash scripts/device.sh optests ops``: the test passes and three rounds show a win, and it becomes
the default with a measured dispatch rule (the buckets where it wins), or it is deleted.
"""

from __future__ import annotations

import functools

import triton
from triton.runtime.autotuner import Autotuner, Heuristics

_tuned: dict = {}


def by_sequence_heads(kernel, sequence_heads: int):
    """``kernel`` (fla's heuristics over its autotuner over the compiled function) with an autotuner
    of its own for the power-of-two bucket of ``sequence_heads``; ``kernel`` itself where it is
    wrapped another way."""
    key = (id(kernel), triton.next_power_of_2(sequence_heads))
    tuned = _tuned.get(key)
    if tuned is None:
        tuned = _tuned.setdefault(key, _bucket_kernel(kernel, key[1]))
    return tuned


def _bucket_kernel(kernel, bucket: int):
    heuristics = kernel
    autotuner = getattr(heuristics, "fn", None)
    if not isinstance(heuristics, Heuristics) or not isinstance(autotuner, Autotuner):
        return kernel
    tuner = _bucketed(type(autotuner))(
        autotuner.fn,
        autotuner.arg_names,
        autotuner.configs,
        autotuner.keys,
        autotuner.reset_to_zero,
        autotuner.restore_value,
        prune_configs_by={
            "perf_model": autotuner.perf_model,
            "top_k": autotuner.configs_top_k,
            "early_config_prune": autotuner.early_config_prune,
        },
        do_bench=autotuner._do_bench,
    )
    tuner.bucket = bucket
    return Heuristics(tuner, heuristics.arg_names, heuristics.values)


@functools.cache
def _bucketed(base: type) -> type:
    class BucketAutotuner(base):
        """``base`` whose tuning results Triton's disk cache files under the bucket too: the
        buckets' autotuners share the kernel and its key, and each must find only its own."""

        bucket = 0

        def check_disk_cache(self, tuning_key, configs, bench_fn):
            bucketed = (*tuning_key, f"sequence_heads<={self.bucket}") if tuning_key else tuning_key
            found = super().check_disk_cache(bucketed, configs, bench_fn)
            if found:
                self.cache[tuning_key] = self.cache.pop(bucketed)
            return found

    return BucketAutotuner
