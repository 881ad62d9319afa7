"""Torch dataset of CT series read straight from DICOM files, preprocessed like a cache."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from milgp.ct.cache_params import CacheParams
from milgp.ct.dataset import uniform_subsample
from milgp.ct.series import load_series
from milgp.ct.windows import ct_channels

__all__ = ["DicomSeriesDataset"]


class DicomSeriesDataset(torch.utils.data.Dataset):
    """Items ``(slices (S, C, H, W) float32 in [0, 1], None, nan, series id)``: one CT series per
    item, ordered along the scan axis (:func:`milgp.ct.series.load_series`), windowed and
    resized as a cache would (:func:`milgp.ct.windows.ct_channels`) and, with ``storage_dtype``,
    quantised as the cache stores it (:meth:`milgp.ct.cache_params.CacheParams.encode`), so a
    model trained on a cache sees the values it was trained on; the label is unknown.

    Args:
        series: ``(id, file paths)`` of every series.
        windows: ``(center, width)`` display windows in HU, one channel each.
        size: slice size ``(H, W)`` in pixels (``None``: native).
        max_slices: keep at most this many evenly spaced slices.
        storage_dtype: the training cache's storage dtype (``"uint8"``, ``"float16"``) whose
            rounding to apply, or ``None`` for the windowed values as they are.
    """

    def __init__(self, series: Sequence[tuple[str, Sequence[str]]], windows: Sequence[Sequence[float]],
                 size: Sequence[int] | int | None, max_slices: int | None = None, storage_dtype: str | None = None):
        self.series = [(str(b), [str(p) for p in paths]) for b, paths in series]
        self.windows = [(float(c), float(w)) for c, w in windows]
        self.size = None if size is None else (tuple(int(v) for v in size) if not isinstance(size, int) else (size, size))
        self.max_slices = max_slices
        self.storage = None if storage_dtype is None else CacheParams(windows=self.windows, size=self.size, dtype=storage_dtype)

    def __len__(self) -> int:
        return len(self.series)

    def __getitem__(self, i: int) -> tuple[Tensor, None, float, str]:
        bag_id, paths = self.series[i]
        ct = load_series(paths)
        x = ct_channels(ct.hu, self.windows, self.size)[uniform_subsample(len(ct.hu), self.max_slices)]
        if self.storage is not None:
            x = self.storage.decode(self.storage.encode(x))
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), None, float("nan"), bag_id
