"""numpy arrays as `.npy` files on any fsspec URL: the per-sequence byte counts of a token cache and
the text hashes of a document set."""

from __future__ import annotations

import io

import numpy as np

from keel.executor import storage


def write_array(url: str, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    fs, path = storage.split(url)
    fs.pipe_file(path, buffer.getvalue())


def read_array(url: str) -> np.ndarray | None:
    """The array at `url`, or None where there is no file (an output written before keel wrote it)."""
    if not storage.exists(url):
        return None
    fs, path = storage.split(url)
    return np.load(io.BytesIO(fs.cat_file(path)))
