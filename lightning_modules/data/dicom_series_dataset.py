"""Torch dataset of CT series read straight from DICOM files, preprocessed like a cache."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from milgp.data.ct_dataset import uniform_subsample
from milgp.data.ct_series import load_series
from milgp.data.windows import ct_channels

__all__ = ["DicomSeriesDataset"]


class DicomSeriesDataset(torch.utils.data.Dataset):
    """Items ``(slices (S, C, H, W) float32 in [0, 1], None, nan, series id)``: one CT series per
    item, ordered along the scan axis (:func:`milgp.data.ct_series.load_series`) and windowed and
    resized as a cache would (:func:`milgp.data.windows.ct_channels`); the label is unknown.

    Args:
        series: ``(id, file paths)`` of every series.
        windows: ``(center, width)`` display windows in HU, one channel each.
        size: slice size ``(H, W)`` in pixels (``None``: native).
        max_slices: keep at most this many evenly spaced slices.
    """

    def __init__(self, series: Sequence[tuple[str, Sequence[str]]], windows: Sequence[Sequence[float]],
                 size: Sequence[int] | int | None, max_slices: int | None = None):
        self.series = [(str(b), [str(p) for p in paths]) for b, paths in series]
        self.windows = [(float(c), float(w)) for c, w in windows]
        self.size = None if size is None else (tuple(int(v) for v in size) if not isinstance(size, int) else (size, size))
        self.max_slices = max_slices

    def __len__(self) -> int:
        return len(self.series)

    def __getitem__(self, i: int) -> tuple[Tensor, None, float, str]:
        bag_id, paths = self.series[i]
        ct = load_series(paths)
        x = ct_channels(ct.hu, self.windows, self.size)[uniform_subsample(len(ct.hu), self.max_slices)]
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), None, float("nan"), bag_id
