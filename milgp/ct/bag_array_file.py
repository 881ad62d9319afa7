"""Checked access to one cached bag's ``.npy`` file.

A cached bag is an uncompressed ``.npy`` file ``(S, C, H, W)``. On disk it can be truncated,
emptied, overwritten by random bytes or replaced by another bag's array; checking it first gives
an error naming the file instead of an ``mmap`` error in the middle of an epoch.
"""
from __future__ import annotations

import os

import numpy as np
from numpy.lib import format as npy_format

from milgp.data.atomic import file_sha256

__all__ = ["array_file_problem", "open_array_file", "read_npy_header"]

_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def read_npy_header(path: str | os.PathLike[str]) -> tuple[tuple[int, ...], np.dtype, int, int]:
    """``(shape, dtype, data offset, file size)`` from a ``.npy`` header.

    Raises:
        ValueError: saying why the header is unreadable (empty file, not ``.npy``, Fortran order).
        OSError: when the file cannot be opened.
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ValueError("empty file (0 bytes)")
        try:
            version = npy_format.read_magic(fh)
            reader = _HEADER_READERS.get(version)
            if reader is None:
                raise ValueError(f".npy format version {version}; the cache writes 1.0 or 2.0")
            shape, fortran, dtype = reader(fh)
        except Exception as err:  # numpy raises ValueError/EOFError/SyntaxError for damaged headers
            raise ValueError(f"not a readable .npy file ({type(err).__name__}: {err})") from None
        if fortran:
            raise ValueError("Fortran-ordered array; the cache writes C order")
        return tuple(int(s) for s in shape), np.dtype(dtype), fh.tell(), size


def array_file_problem(
    path: str | os.PathLike[str], shape: tuple[int, ...], dtype: str | np.dtype, sha256: str | None = None
) -> str:
    """Why ``path`` is not the expected cached array (``""`` when it is).

    Checks the header, the shape, the dtype and the file size (header + data exactly); with
    ``sha256`` also the checksum of the whole file (reads every byte).
    """
    try:
        got_shape, got_dtype, offset, size = read_npy_header(path)
    except FileNotFoundError:
        return "file missing"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except ValueError as err:
        return str(err)
    if got_shape != tuple(shape):
        return f"holds an array of shape {got_shape}, the manifest says {tuple(shape)} (another bag's array?)"
    if got_dtype != np.dtype(dtype):
        return f"holds {got_dtype} values, the cache stores {np.dtype(dtype)}"
    expected = offset + int(np.prod(got_shape)) * got_dtype.itemsize
    if size != expected:
        return f"is {size} bytes, {expected} expected for {got_shape} {got_dtype} (truncated or appended to)"
    if sha256 is not None:
        try:
            if file_sha256(path) != sha256:
                return "content does not match its checksum (corrupted or overwritten)"
        except OSError as err:
            return f"cannot be read ({err.strerror or err})"
    return ""


def open_array_file(path: str | os.PathLike[str], shape: tuple[int, ...], dtype: str | np.dtype, mmap: bool = True) -> np.ndarray:
    """The array of a cached bag, memory-mapped (``mmap``) or read, after :func:`array_file_problem`'s cheap checks.

    Raises:
        ValueError: saying what is wrong with the file (the caller names the bag and the file).
    """
    problem = array_file_problem(path, shape, dtype)
    if problem:
        raise ValueError(problem)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"cannot be loaded ({type(err).__name__}: {err})") from None
