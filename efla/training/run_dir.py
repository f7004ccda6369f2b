"""An ``efla train`` output directory: whether it is ours, and an exclusive lock on it.

A run directory holds ``.efla-run.lock`` from its first moment (created by :func:`claim_run_dir`);
runs written before that file existed are recognised by their ``train_args.json``. The lock is a
POSIX ``flock`` on that file, which the kernel drops when its process dies, so the lock of a killed
run is never in the way: the next run takes it over and says so. The file records the holder (pid,
host, command, start time) so a refused run can name it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from efla.errors import UsageError

__all__ = ["LOCK_NAME", "RunLock", "is_efla_run", "check_out_dir", "claim_run_dir"]

LOCK_NAME = ".efla-run.lock"
_RUN_FILES = (LOCK_NAME, "train_args.json")


def is_efla_run(path: str) -> bool:
    """``path`` holds an ``efla train`` run (its lock file or its ``train_args.json``)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in _RUN_FILES)


def check_out_dir(path: str, overwrite: bool) -> None:
    """Refuses an output directory that holds anything but an ``efla train`` run, unless ``overwrite``.

    Raises:
        UsageError: ``path`` is a file, or a non-empty directory that is not an efla run.
    """
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise UsageError(f"{path} exists and is not a directory (--out)")
    if overwrite or is_efla_run(path) or not os.listdir(path):
        return
    shown = ", ".join(sorted(os.listdir(path))[:4])
    raise UsageError(
        f"{path} is not empty and holds no efla run ({shown}...); choose a new or empty directory, "
        "or pass --overwrite to write into it anyway (--out)"
    )


def _holder_record(command: str) -> dict:
    return dict(pid=os.getpid(), host=socket.gethostname(), command=command, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _describe_holder(record: dict) -> str:
    if not record:
        return "another process"
    return f"pid {record.get('pid')} on {record.get('host')} since {record.get('started')} ({record.get('command')})"


@dataclass
class RunLock:
    """An exclusive lock on a run directory; ``stale_holder`` is the record of a killed run taken over."""

    path: str
    fd: int
    stale_holder: dict | None = None

    def release(self) -> None:
        import fcntl  # noqa: PLC0415 (lazy: POSIX only; elsewhere runs go unlocked)

        if self.fd < 0:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def _read_record(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        record = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def claim_run_dir(path: str, command: str | None = None) -> RunLock:
    """Creates ``path`` if needed and takes its exclusive lock.

    Raises:
        UsageError: another live process holds the lock (the message names it).
    """
    import fcntl  # noqa: PLC0415 (lazy: POSIX only; elsewhere runs go unlocked)

    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_record(fd)
        os.close(fd)
        raise UsageError(
            f"{path} is in use by {_describe_holder(holder)}; wait for it to finish or choose another directory (--out)"
        ) from None
    stale = _read_record(fd) or None
    record = json.dumps(_holder_record(command or "efla " + " ".join(sys.argv[1:])))
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode("utf-8"), 0)
    os.fsync(fd)
    return RunLock(path, fd, stale_holder=stale)
