"""Where the shared data sets live: ``$EFLA_DATA_DIR``, else ``../shared/data`` beside the working
directory or beside the repository (the layout of a checkout next to a shared data folder)."""

from __future__ import annotations

import os
import pathlib

from efla import environment

__all__ = ["shared_data_dirs", "find_shared"]


def shared_data_dirs() -> list[pathlib.Path]:
    """The folders searched for shared data, in order."""
    repository = pathlib.Path(__file__).resolve().parents[2]
    beside_cwd, beside_repository = pathlib.Path.cwd().parent / "shared" / "data", repository.parent / "shared" / "data"
    dirs = [environment.get("EFLA_DATA_DIR"), beside_cwd, beside_repository]
    return [pathlib.Path(os.path.normpath(d)) for d in dirs if d]


def find_shared(*parts: str, is_dir: bool = False) -> pathlib.Path | None:
    """The first ``<shared data folder>/<parts...>`` that exists (a file, or a folder with ``is_dir``)."""
    for folder in shared_data_dirs():
        candidate = folder.joinpath(*parts)
        if candidate.is_dir() if is_dir else candidate.is_file():
            return candidate
    return None
