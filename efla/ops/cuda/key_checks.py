"""When the GPU chunk kernels' overflowing-key flags are read (keys whose ``||k||^2`` overflows
float32 give NaN there; the flag turns that into ``efla.ops.validate.key_energy_error``'s message).

One switch, ``EFLA_CHECK_KEYS`` (``efla.environment``): by default (``later``) a flag is copied
to the host behind the call's kernels and a set one raises at the next chunk call of the thread
that finds the copy arrived, or at ``check_keys()``, which waits for it; ``sync`` (and
``immediate_key_checks()``) reads each call's flag at once, one device sync per call; ``off``
reads none. Inside
``deferred_key_checks()`` the flags are read at the block's end: one device sync there (the models
run their layers so). Only torch is imported here: the CPU paths use the switch too.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from efla import environment


def key_check_mode() -> str:
    """How the GPU paths refuse keys whose ``||k||^2`` overflows float32 (``EFLA_CHECK_KEYS``):
    ``"later"`` (default) the chunk kernels' flags are read once their copy reaches the host (no
    stall); ``"sync"`` each call reads its flag at once (a device sync per call); ``"off"`` nothing
    is checked, such keys give NaN."""
    return environment.get("EFLA_CHECK_KEYS")


def key_checks_enabled() -> bool:
    """Whether the GPU paths refuse keys whose ``||k||^2`` overflows float32 (``EFLA_CHECK_KEYS=0``
    turns it off)."""
    return key_check_mode() != "off"


_deferred = threading.local()  # per thread: id -> (flag, stream) of each chunk call inside deferred_key_checks()


@contextlib.contextmanager
def deferred_key_checks():
    """Read the GPU chunk kernels' overflowing-key flags once, when the block ends, instead of after
    every call (each read is a device sync that stalls the host until the GPU catches up). A call
    with such keys returns NaN meanwhile, and the block raises the ``ValueError`` as it ends, also
    when that NaN made something else inside fail first (with that failure as the cause). What the
    block changed in place stays changed: a cache passed to a model then holds NaN states. Each
    flag is read in the stream its kernel ran in. Nested blocks leave the check to the outermost."""
    if getattr(_deferred, "flags", None) is not None:
        yield
        return
    _deferred.flags = flags = {}
    try:
        yield
    except BaseException as failure:
        if _read_and_reset(flags, quiet=True):
            raise _deferred_key_error() from failure
        raise
    finally:
        _deferred.flags = None
    if _read_and_reset(flags):
        raise _deferred_key_error()


@contextlib.contextmanager
def immediate_key_checks():
    """Every chunk call inside reads its own flag, also within ``deferred_key_checks()``: where the
    error must come from the call itself (a context-parallel rank, whose peers learn of it there)."""
    saved = getattr(_deferred, "flags", None), getattr(_deferred, "immediate", False)
    _deferred.flags, _deferred.immediate = None, True
    try:
        yield
    finally:
        _deferred.flags, _deferred.immediate = saved


def read_each_call() -> bool:
    """Whether a chunk call outside ``deferred_key_checks()`` reads its own flag at once
    (``EFLA_CHECK_KEYS=sync`` or inside ``immediate_key_checks()``) rather than later."""
    return getattr(_deferred, "immediate", False) or key_check_mode() == "sync"


def _deferred_key_error() -> ValueError:
    return ValueError(
        "k: a key's squared norm ||k||^2 overflows float32 in a chunk call of this block "
        f"(max {torch.finfo(torch.float32).max:.4g}); scale the keys down"
    )


def _read_and_reset(flags: dict, quiet: bool = False) -> bool:
    """Whether any flag is set, each read in its own stream (read in another, it could overtake the
    kernel that sets it); zeroed again for later calls when set. ``quiet``: a read that fails (the
    block failed already, perhaps on the device) counts as not set."""
    try:
        overflowed = False
        for flag, stream in flags.values():
            with _in_stream(stream):
                if flag.item():
                    overflowed = True
                    reset_flag(flag)
        return overflowed
    except Exception:
        if quiet:
            return False
        raise


def _in_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def defer_key_check(flag: torch.Tensor) -> bool:
    """Hand a chunk call's overflow flag to the enclosing ``deferred_key_checks()`` (``True``), or
    leave reading it to the caller where there is none (``False``)."""
    flags = getattr(_deferred, "flags", None)
    if flags is None:
        return False
    stream = torch.cuda.current_stream(flag.device) if flag.is_cuda else None
    flags[id(flag)] = (flag, stream)
    return True


@dataclass
class _LaterCheck:
    """A flag read without stalling: ``host`` holds its value as of the latest copy, which
    ``event`` follows in the flag's ``stream`` (``None``: a CPU flag, copied at once)."""

    flag: torch.Tensor
    host: torch.Tensor
    stream: object
    event: object


_later = threading.local()  # per thread: id(flag) -> _LaterCheck of each flag handed to check_flag_later


def _later_checks() -> dict:
    checks = getattr(_later, "checks", None)
    if checks is None:
        checks = _later.checks = {}
    return checks


def check_flag_later(flag: torch.Tensor) -> None:
    """Copy a chunk call's flag to the host behind its kernels, for ``raise_earlier_overflows`` to
    read once the copy has arrived. The flags only ever go from 0 to 1, so the latest copy of a
    flag stands for every call before it."""
    checks = _later_checks()
    check = checks.get(id(flag))
    if check is None or check.flag is not flag:
        cuda = flag.is_cuda
        check = checks[id(flag)] = _LaterCheck(
            flag,
            torch.zeros(1, dtype=flag.dtype, pin_memory=cuda),
            torch.cuda.current_stream(flag.device) if cuda else None,
            torch.cuda.Event() if cuda else None,
        )
    check.host.copy_(check.flag, non_blocking=check.event is not None)
    if check.event is not None:
        check.event.record(check.stream)


def raise_earlier_overflows(wait: bool = False) -> None:
    """Raise the ``ValueError`` for a key that overflowed in an earlier chunk call of this thread
    whose flag has reached the host (``wait``: wait for every flag's copy first), and reset that
    flag for later calls."""
    for check in _later_checks().values():
        if check.event is not None:
            if wait:
                check.event.synchronize()
            elif not check.event.query():
                continue
        if check.host.item():
            with _in_stream(check.stream):
                reset_flag(check.flag)
            raise ValueError(
                "k: a key's squared norm ||k||^2 overflowed float32 "
                f"(max {torch.finfo(torch.float32).max:.4g}) in an earlier chunk call on this thread, "
                "whose output is NaN; scale the keys down (EFLA_CHECK_KEYS=sync raises from that call "
                "itself, at one device sync per call)"
            )


def check_keys() -> None:
    """Wait for the overflowing-key checks of this thread's earlier chunk calls on the GPU and raise
    their ``ValueError`` if a key overflowed (without it, the error comes at a later chunk call)."""
    raise_earlier_overflows(wait=True)


def reset_flag(flag: torch.Tensor) -> None:
    """Zero a flag that was found set, and its host copy, for the calls after it (in the current
    stream: the flag's own, where the caller read it)."""
    flag.zero_()
    check = _later_checks().get(id(flag))
    if check is not None and check.flag is flag:
        if check.event is not None:
            check.event.synchronize()
        check.host.zero_()
