"""Pixel-sequence classification data: MNIST from idx(.gz) files, or scikit-learn's bundled digits.

Each image becomes a sequence of scalar pixels in [0, 1] (784 for MNIST, 64 for the 8x8 digits).
"""

from __future__ import annotations

import gzip
import os
import pathlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from efla.data.shared import shared_data_dirs

_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass
class PixelData:
    name: str  # "mnist" or "digits"
    x_train: torch.Tensor  # [N, L] float32 in [0, 1]
    y_train: torch.Tensor  # [N] int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str  # where it came from, for the record

    @property
    def seq_len(self) -> int:
        return self.x_train.shape[1]


def _read_idx(path: pathlib.Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: a truncated or damaged gzip file ({e}) (--data-dir)") from None
    if len(data) < 4:
        raise ValueError(f"{path}: not an idx file (too short) (--data-dir)")
    zero, dtype_code, ndim = data[0:2], data[2], data[3]
    if zero != b"\x00\x00" or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file (magic {data[:4].hex()}) (--data-dir)")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: holds {arr.size} values, its header says {dims} (truncated?) (--data-dir)")
    return arr.reshape(dims)


def _find_file(folder: pathlib.Path, stem: str) -> pathlib.Path | None:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz", stem.replace("-idx", ".idx")):
        p = folder / name
        if p.is_file():
            return p
    return None


def find_mnist_dir(path: str | os.PathLike | None) -> pathlib.Path | None:
    """Return a folder holding the four MNIST idx files, accepting ``DIR``, ``DIR/raw`` and
    torchvision's ``DIR/MNIST/raw``; ``None`` if none is found."""
    if path is None:
        return None
    base = pathlib.Path(path)
    for cand in (base, base / "raw", base / "MNIST" / "raw", base / "mnist"):
        if cand.is_dir() and all(_find_file(cand, s) for s in _MNIST_FILES.values()):
            return cand
    return None


def default_mnist_dir() -> pathlib.Path | None:
    """The MNIST files in ``mnist/`` of a shared data folder (:func:`efla.data.shared.shared_data_dirs`)."""
    for folder in shared_data_dirs():
        found = find_mnist_dir(folder / "mnist")
        if found:
            return found
    return None


def load_mnist_sequences(path) -> PixelData:
    folder = find_mnist_dir(path)
    if folder is None:
        raise ValueError(
            f"data_dir: no MNIST idx files ({', '.join(_MNIST_FILES.values())}, optionally .gz) in {path} "
            "or its raw/ or MNIST/raw/ subfolder"
        )
    arrs = {k: _read_idx(_find_file(folder, s)) for k, s in _MNIST_FILES.items()}
    to_x = lambda a: torch.from_numpy(a.reshape(a.shape[0], -1).astype(np.float32) / 255.0)  # noqa: E731
    to_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return PixelData(
        "mnist",
        to_x(arrs["train_images"]),
        to_y(arrs["train_labels"]),
        to_x(arrs["test_images"]),
        to_y(arrs["test_labels"]),
        source=str(folder),
    )


def load_digits_sequences(test_fraction: float = 0.25, seed: int = 0) -> PixelData:
    """scikit-learn's bundled 8x8 digits (1797 images, no download) as length-64 sequences."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.reshape(len(d.images), -1).astype(np.float32) / 16.0)
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(x)))
    te, tr = perm[:n_test], perm[n_test:]
    return PixelData("digits", x[tr], y[tr], x[te], y[te], source="sklearn.datasets.load_digits (bundled)")


def load_pixel_data(dataset: str = "auto", data_dir=None) -> PixelData:
    """``dataset``: "mnist", "digits" or "auto" (MNIST from ``data_dir`` or the default location
    if found, otherwise the embedded digits)."""
    if dataset not in ("auto", "mnist", "digits"):
        raise ValueError(f"dataset: expected 'auto', 'mnist' or 'digits', got {dataset!r}")
    if dataset == "digits":
        return load_digits_sequences()
    folder = find_mnist_dir(data_dir) if data_dir is not None else default_mnist_dir()
    if data_dir is not None and folder is None:
        raise ValueError(f"no MNIST idx files found in {data_dir} (--data-dir)")
    if folder is None:
        if dataset == "mnist":
            raise ValueError("no MNIST files found; pass --data-dir DIR (--dataset mnist)")
        return load_digits_sequences()
    return load_mnist_sequences(folder)
