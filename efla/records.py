"""What a run leaves behind: its provenance (versions, device, command line), files written atomically,
records (JSON lines) and progress bars; shared by training, evaluation and the lab."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field

__all__ = [
    "versions",
    "default_device",
    "command_line",
    "Provenance",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_csv",
    "write_records",
    "read_records",
    "recorded",
    "progress_factory",
]


def versions(*extra_modules: str) -> dict:
    """Versions of efla, torch, python and ``extra_modules`` (those installed), the machine and the GPU."""
    import importlib  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

    import torch  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

    import efla  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

    found = {"efla": efla.__version__, "torch": torch.__version__}
    for name in extra_modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found[name] = getattr(module, "__version__", "installed")
    found.update(
        python=platform.python_version(),
        machine=platform.machine(),
        cuda_device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    )
    return found


def default_device() -> str:
    """``cuda`` when a GPU is usable, else ``cpu`` (the default of the experiments' ``--device``)."""
    try:
        import torch  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001  a broken CUDA setup must not break ``efla --help``
        return "cpu"


def command_line(argv: list[str] | None = None) -> str:
    """The ``efla`` command being run, from ``argv`` (default ``sys.argv[1:]``), quoted for a shell."""
    return shlex.join(["efla", *(sys.argv[1:] if argv is None else argv)])


@dataclass
class Provenance:
    """What produced a result: the command actually run, the versions, the device and the wall time.

    Made when the command starts; ``record`` is stored with the results when they are written."""

    command: str = field(default_factory=command_line)
    device: str | None = None
    started: float = field(default_factory=time.time)

    @property
    def wall_seconds(self) -> float:
        return time.time() - self.started

    def record(self, *extra_modules: str) -> dict:
        return dict(
            command=self.command, versions=versions(*extra_modules), device=self.device, wall_seconds=round(self.wall_seconds, 3)
        )


def _atomic_replace(path: str, write, binary: bool) -> None:
    """Replaces ``path`` with what ``write(file)`` writes, in one step: a reader sees the old file or
    the new one, never a part (a synced temporary file, renamed; removed if the write fails)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def atomic_write(path: str, text: str) -> None:
    """Replaces ``path`` with ``text`` in one step: a reader sees the old file or the new one, never a part."""
    _atomic_replace(path, lambda f: f.write(text), binary=False)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Replaces ``path`` with ``data`` in one step, like ``atomic_write``."""
    _atomic_replace(path, lambda f: f.write(data), binary=True)


def atomic_save_torch(path: str, obj) -> None:
    """``torch.save(obj)`` to ``path`` in one step, like ``atomic_write``."""
    import torch  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

    _atomic_replace(path, lambda f: torch.save(obj, f), binary=True)


def atomic_write_json(path: str, obj, indent: int = 1) -> None:
    atomic_write(path, json.dumps(obj, indent=indent))


def write_records(path: str, records: list[dict]) -> None:
    """``records`` as JSON Lines (one object per line), atomically: a recorded experiment's runs in
    one file rather than one file per run."""
    atomic_write(path, "".join(json.dumps(record) + "\n" for record in records))


def read_records(path: str) -> list[dict]:
    """The objects of a JSON Lines file written by ``write_records``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def recorded(record_dir: str, ref: str, key: str = "key") -> dict:
    """The run a recorded result lists as ``ref``: ``FILE#NAME``, the object of JSON Lines ``FILE``
    (relative to ``record_dir``) whose ``key`` is ``NAME``; or a JSON file's path."""
    path, _, name = ref.partition("#")
    path = os.path.join(record_dir, path)
    if not name:
        with open(path) as f:
            return json.load(f)
    found = [r for r in read_records(path) if r.get(key) == name]
    if len(found) != 1:
        raise KeyError(f"{ref}: {len(found)} records named {name!r} in {path}")
    return found[0]


def atomic_write_csv(path: str, header: list, rows) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write(path, buffer.getvalue())


def progress_factory(**options):
    """``factory(total, desc)`` making a tqdm bar that disappears when done; ``options`` go to tqdm."""
    from tqdm.auto import tqdm

    settings = dict(leave=False, dynamic_ncols=True) | options
    return lambda total, desc, **more: tqdm(total=total, desc=desc, **(settings | more))
