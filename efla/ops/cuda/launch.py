"""Triton launches without Triton's per-call Python after the first.

A ``kernel[grid](**args)`` call runs Python on the host before the GPU sees the kernel: the
heuristics and autotuner wrappers rebuild their dicts, the binder specialises every argument and
hashes the result, and fla's wrappers add their own dispatch. Measured on the H200 (2026-12-03),
the EFLA chunk forward at [8, 2048, 16] spent about 1 ms of host time on five launches against
0.7 ms of GPU work, so the GPU waited on the host.

``launch`` runs the first call of each specialisation through Triton as usual (compiling and
autotuning there) and records what Triton chose: the compiled kernel and the values of every
parameter, constants included. A later call whose arguments specialise the same way (same dtypes,
16-byte alignment of every pointer, ``None``-ness, and equal ints, floats, bools and constants)
goes straight to the compiled kernel's launcher with its own tensors. A heuristic's value is kept
from the first call, so heuristics may depend only on what the key holds (fla's used here test
whether an argument is ``None``). Anything the record cannot
stand for runs through Triton every time: Triton's CPU interpreter (no compiled kernel), an
autotuner setting with a pre-launch hook, an argument of a type not listed.

On by default on the Triton releases it was tested with (``supported.py``: any other launches
through Triton, with one warning); ``EFLA_DIRECT_LAUNCH=0`` sends every launch through Triton. On
the CPU, with a stand-in driver, the replayed launches pass Triton's own grid, stream and argument
vector for every stage (``tests/ops/test_launch.py``); on the GPU the same file checks replayed
chunk ops bit for bit against the ops through Triton. The speed it buys is in ``docs/performance.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

from efla import environment

from .supported import direct_launcher_tested

try:
    from triton import knobs
except ImportError:  # an older Triton, not one the direct launcher was tested with: never read
    knobs = None

_NO_RECORD = object()  # a specialisation that always runs through Triton


@dataclass(frozen=True)
class _Record:
    compiled: object
    jit: JITFunction
    parameters: dict  # every parameter in the kernel's order: what Triton chose, None for the caller's
    passed: tuple  # the parameters the caller passes at every call, as they reach the kernel


_records: dict = {}
_recording = threading.RLock()
MAX_RECORDS = 4096  # ints are keyed by value (a varlen batch's T, say): the table is emptied past this


def direct_launches() -> bool:
    """Whether launches after the first of their specialisation skip Triton's Python
    (``EFLA_DIRECT_LAUNCH``, on by default)."""
    return environment.get("EFLA_DIRECT_LAUNCH")


def launch(kernel, grid, /, **args):
    """``kernel[grid](**args)``: ``grid`` a tuple, or a function of the parameters (the autotuned
    ones included) as Triton takes it."""
    if environment.get("TRITON_INTERPRET") or not direct_launches() or not direct_launcher_tested():
        return kernel[grid](**args)
    key = _specialisation(kernel, args)
    record = _records.get(key) if key is not None else _NO_RECORD
    if record is None:
        with _recording:
            return _record_first_launch(kernel, grid, key, args)
    if record is _NO_RECORD or record.jit.pre_run_hooks:  # a hook of someone else's must see the call
        return kernel[grid](**args)
    parameters = dict(record.parameters)
    for name in record.passed:
        parameters[name] = args[name]
    grid = grid(parameters) if callable(grid) else grid
    return _run(record.compiled, grid, parameters.values())


def _run(compiled, grid, values):
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    values = tuple(values)
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    enter_hook = knobs.runtime.launch_enter_hook
    compiled.run(
        grid_x,
        grid_y,
        grid_z,
        stream,
        compiled.function,
        compiled.packed_metadata,
        compiled.launch_metadata(grid, stream, *values) if enter_hook is not None else None,
        enter_hook,
        knobs.runtime.launch_exit_hook,
        *values,
    )
    return compiled


def _specialisation(kernel, args) -> tuple | None:
    """What Triton's compiled kernel and the autotuner's choice depend on, or ``None`` where an
    argument's type is not one this module knows how Triton specialises."""
    key = [id(kernel), torch.cuda.current_device(), knobs.runtime.debug, knobs.compilation.instrumentation_mode]
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and value == value):
            key.append((name, type(value), value))
        else:  # NaN would never find its own record
            return None
    return tuple(key)


def _record_first_launch(kernel, grid, key, args):
    record = _records.get(key)  # another thread may have recorded it meanwhile
    if record is not None:
        return launch(kernel, grid, **args)
    jit, final_kwargs = _innermost(kernel), {}
    if jit is None:
        _records[key] = _NO_RECORD
        return kernel[grid](**args)

    recorder = threading.get_ident()

    def remember(*_, **kwargs):  # the hook sees every thread's calls of this kernel: ours only
        if threading.get_ident() == recorder:
            final_kwargs.clear()
            final_kwargs.update(kwargs)

    jit.pre_run_hooks.append(remember)
    try:
        compiled = kernel[grid](**args)
    finally:
        jit.pre_run_hooks.remove(remember)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    if len(_records) >= MAX_RECORDS:
        _records.clear()
    _records[key] = _record(kernel, jit, compiled, final_kwargs, args)
    return compiled


def _innermost(kernel) -> JITFunction | None:
    """The compiled function under the heuristics and autotuner wrappers, or ``None`` where a
    wrapper is of another kind."""
    while not isinstance(kernel, JITFunction):
        if not isinstance(kernel, (Autotuner, Heuristics)):
            return None
        kernel = kernel.fn
    return kernel


def _record(kernel, jit, compiled, final_kwargs, args):
    """The record of a first launch, or ``_NO_RECORD`` where a later call must run through Triton."""
    if not hasattr(compiled, "packed_metadata") or not final_kwargs or _has_launch_hook(kernel):
        return _NO_RECORD
    parameters, passed = {}, []
    for parameter in jit.params:
        name = parameter.name
        if name in args and name in final_kwargs and final_kwargs[name] is args[name]:
            parameters[name] = None  # the caller's at every call: a record holds no tensor alive
            passed.append(name)
        elif name in final_kwargs:  # a heuristic's or the autotuner's choice (or a caller's, overridden)
            parameters[name] = final_kwargs[name]
        elif parameter.has_default:
            parameters[name] = parameter.default
        else:
            return _NO_RECORD
    if not all(value is None or isinstance(value, (bool, int, float, str)) for value in parameters.values()):
        return _NO_RECORD  # a tensor (or the like) that is not the caller's: nothing to replay it with
    return _Record(compiled, jit, parameters, tuple(passed))


def _has_launch_hook(kernel) -> bool:
    """Whether a wrapper runs code of its own at each launch that a record would skip (an autotuned
    setting's pre-launch hook)."""
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Autotuner):
            config = getattr(kernel, "best_config", None)
            if config is None or config.pre_hook is not None:
                return True
        elif not isinstance(kernel, Heuristics):
            return True
        kernel = kernel.fn
    return False
