"""Torch dataset of CT series read straight from DICOM files, preprocessed like a cache."""
from __future__ import annotations

import sys
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from lightning_modules.distributed import rank, world_size
from milgp.ct.cache_params import CacheParams
from milgp.ct.dataset import uniform_subsample
from milgp.ct.report_entry import printable
from milgp.ct.series import load_series
from milgp.ct.windows import ct_channels

__all__ = ["DicomSeriesDataset", "report_skipped"]


def report_skipped(what: str, reason: str) -> None:
    """The one stderr line of a file or series left out of a prediction."""
    print(f"milgp: skipped {printable(what)}: {reason}", file=sys.stderr)


class DicomSeriesDataset(torch.utils.data.IterableDataset):
    """One CT series per item, as a dict for :func:`milgp.data.bags.collate_bags`: ``x`` (slices
    ``(S, C, H, W)`` float32 in [0, 1]), ``bag_id``, ``bag_label`` (nan: unknown) and, for the
    slices served, ``positions`` ``(S,)`` with their ``position_axis``. Each series is ordered along
    the scan axis (:func:`milgp.ct.series.load_series`), windowed and resized as a cache would
    (:func:`milgp.ct.windows.ct_channels`) and, with ``storage_dtype``, quantised as the cache
    stores it (:meth:`milgp.ct.cache_params.CacheParams.encode`), so a model trained on a cache sees
    the values it was trained on.

    Pixels are read only here, so what cannot be decoded is found here: a series with no decodable
    slice (or slices of different sizes) is skipped and a slice that cannot be decoded is left out,
    each reported in one line on stderr (:func:`report_skipped`), and the other series are served.
    A series' item lists its slices left out (``skipped``: ``(path, reason)``); a series skipped
    whole is recorded in :attr:`failed` (of the process that read it).
    Under several DataLoader workers and DDP ranks each series is read by exactly one of them.

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
        self.failed: dict[str, str] = {}
        """Series id → why none of its slices could be used (the series this process read)."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = torch.utils.data.get_worker_info()
        workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        for i in range(rank() * workers + worker_id, len(self.series), world_size() * workers):
            item = self.read(i)
            if item is not None:
                yield item

    def read(self, i: int) -> dict[str, Any] | None:
        """Series ``i`` as an item, or ``None`` (reported) when none of its slices can be used."""
        bag_id, paths = self.series[i]
        try:
            ct = load_series(paths)
        except ValueError as err:
            report_skipped(f"series {bag_id}", str(err))
            self.failed[bag_id] = str(err)
            return None
        for entry in ct.skipped:
            report_skipped(entry.path, entry.reason)
        served = uniform_subsample(len(ct.hu), self.max_slices)
        x = ct_channels(ct.hu, self.windows, self.size)[served]
        if self.storage is not None:
            x = self.storage.decode(self.storage.encode(x))
        axis = "position along the scan axis (mm)" if ct.ordering == "geometry" else "InstanceNumber"
        return {"x": torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), "bag_label": float("nan"), "bag_id": bag_id,
                "positions": ct.positions[served], "position_axis": axis, "skipped": [(str(e.path), e.reason) for e in ct.skipped]}
