"""The lab's data: MNIST and the embedded digits as sequences of pixels (pixels.py), the MAD tasks
(mad_tasks.py)."""

from efla_lab.data.pixels import PixelData, find_mnist_dir, load_digits_sequences, load_mnist_sequences, load_pixel_data

__all__ = ["PixelData", "find_mnist_dir", "load_digits_sequences", "load_mnist_sequences", "load_pixel_data"]
