"""Data loaders: MNIST idx / embedded digits (sequences of pixels)."""

from .pixels import PixelData, find_mnist_dir, load_digits_sequences, load_mnist_sequences, load_pixel_data

__all__ = ["PixelData", "find_mnist_dir", "load_digits_sequences", "load_mnist_sequences", "load_pixel_data"]
