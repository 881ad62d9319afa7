"""Data module for new, unlabelled scans given as DICOM folders (``predict`` only)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Sequence

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_modules.data.dicom_series_dataset import DicomSeriesDataset, report_skipped
from lightning_modules.input_error import InputError
from milgp.data.bags import BagBatch, collate_bags
from milgp.ct.dicom import read_folder_headers
from milgp.ct.series_check import SeriesRefused, check_series

__all__ = ["DicomDataModule"]


class DicomDataModule(pl.LightningDataModule):
    """CT series from DICOM folders, to predict: every series found under the inputs (one scan per
    SeriesInstanceUID, searched recursively; files that are not DICOM images are skipped) is one
    bag, its id the SeriesInstanceUID, read as :class:`DicomSeriesDataset` says (the values a cache
    gives) with the CT preprocessing saved in the model's checkpoint (``input_preprocessing``) unless
    ``windows``/``size`` are given.

    Its DataLoader yields ``(BagBatch, {series id: (slice positions, axis)}, {series id: slices left
    out})``; the module receives the :class:`~milgp.data.bags.BagBatch` alone
    (:meth:`on_before_batch_transfer` keeps the positions of the slices actually served, which
    :meth:`slice_positions` then gives, and the slices left out, :meth:`left_out`). What was skipped
    is recorded in ``predictions.json`` (:meth:`record_predicted`).

    Args:
        inputs: study or series folders.
        windows: ``(center, width)`` windows in HU (``None``: the model's).
        size: slice size in pixels (``None``: the model's).
        max_slices: keep at most this many evenly spaced slices per series (``None``: all).
        eval_batch_size: series per batch.
        num_workers: DataLoader workers (each reads and windows whole series).
    """

    def __init__(
        self,
        inputs: list[str],
        windows: list[tuple[float, float]] | None = None,
        size: int | None = None,
        max_slices: int | None = None,
        eval_batch_size: int = 1,
        num_workers: int = 0,
    ):
        super().__init__()
        if not inputs:
            raise InputError("DicomDataModule needs at least one DICOM folder")
        missing = [p for p in inputs if not Path(p).is_dir()]
        if missing:
            raise InputError(f"{missing[0]}: {'a file, not a DICOM folder' if Path(missing[0]).exists() else 'no such folder'}")
        self.inputs = [str(p) for p in inputs]
        self.windows, self.size, self.max_slices = windows, size, max_slices
        self.eval_batch_size, self.num_workers = eval_batch_size, num_workers
        self._series: list[tuple[str, list[str]]] = []
        self._positions: dict[str, tuple[np.ndarray, str]] = {}  # of the slices served, per series
        self._source: dict[str, str] = {}
        self._left_out: dict[str, list[tuple[str, str]]] = {}  # slices left out at read, per series served
        self._dataset: DicomSeriesDataset | None = None
        self._unpredicted: dict[str, str] = {}  # series set up but not predicted → why
        self.skipped: list[tuple[str, str]] = []
        """Files and series left out at :meth:`setup` (headers), with the reason; what cannot be
        decoded is found and reported when the pixels are read (:class:`DicomSeriesDataset`)."""

    def setup(self, stage: str) -> None:
        """Read the headers (no pixels), group the files by series, and check and order each series
        as the cache does (:func:`milgp.ct.series_check.check_series`: non-CT, non-axial,
        interleaved or mixed series are refused, duplicates dropped). A refused series or an
        unreadable file is skipped and reported on stderr; the other series are predicted."""
        if stage != "predict":
            raise InputError("DICOM folders are unlabelled scans: use them with predict (milgp-train predict, milgp-predict)")
        if self._series:
            return
        headers_of, unread = read_folder_headers({folder: Path(folder) for folder in self.inputs})
        self.skipped.extend((e.path, e.reason) for e in unread)
        for folder, headers in headers_of.items():
            by_series: dict[str, list] = {}
            for h in headers:
                by_series.setdefault(h.series_uid, []).append(h)
            for uid, group in sorted(by_series.items()):
                if uid in self._source:
                    raise InputError(f"{folder}: series {uid} was found in {self._source[uid]} too")
                try:
                    checked = check_series(group, bag_id=uid)
                except SeriesRefused as err:
                    self.skipped.append((f"{folder} (series {uid})", str(err)))
                    continue
                self.skipped.extend((str(e.path), e.reason) for e in checked.skipped)
                self._series.append((uid, [h.path for h in checked.headers]))
                self._source[uid] = folder
        for path, reason in self.skipped:
            report_skipped(path, reason)
        if not self._series:
            raise InputError(f"{', '.join(self.inputs)}: no readable CT series found")

    def _preprocessing(self) -> tuple[Sequence[Sequence[float]], Any, str | None]:
        """Windows, size and storage dtype: given, else the model's (a model that records no storage
        dtype, from before it was recorded, gets the windowed values unrounded)."""
        model = getattr(getattr(self, "trainer", None), "lightning_module", None)
        stored = getattr(model, "input_preprocessing", None) or {}
        windows = self.windows if self.windows is not None else stored.get("windows")
        size = self.size if self.size is not None else stored.get("size")
        if windows is None:
            raise InputError("the model records no CT preprocessing (it was trained on features): give windows and size, "
                             "or predict with a model that holds its extractor")
        return windows, size, stored.get("dtype")

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        windows, size, dtype = self._preprocessing()
        ds = self._dataset = DicomSeriesDataset(self._series, windows, size, self.max_slices, storage_dtype=dtype)
        return torch.utils.data.DataLoader(ds, batch_size=self.eval_batch_size, collate_fn=_collate, num_workers=self.num_workers)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, tuple):  # this module's own batches: keep the positions served and the slices left out
            batch, positions, left_out = batch
            self._positions.update(positions)
            self._left_out.update(left_out)
        return batch

    def left_out(self, bag_id: str) -> list[tuple[str, str]]:
        """The slices of a series served in this process that were left out when read: ``(path, reason)``."""
        return self._left_out.get(bag_id, [])

    def record_predicted(self, predicted: Collection[str]) -> list[dict[str, str]]:
        """Once the predictions of every rank are gathered: what was skipped, as ``{"what", "reason"}``
        (the files and series refused at :meth:`setup`, and every series set up but not in
        ``predicted``: none of its slices could be read), and :meth:`describe` no longer lists those
        series. The reason of a series skipped when read is its own where this process read it
        (``num_workers=0``, one rank), else a pointer to the stderr line that gave it."""
        failed = self._dataset.failed if self._dataset is not None else {}
        predicted = set(predicted)
        self._unpredicted = {uid: failed.get(uid, "none of its slices could be read (the reason is on stderr)")
                             for uid, _ in self._series if uid not in predicted}
        return ([{"what": what, "reason": reason} for what, reason in self.skipped]
                + [{"what": f"series {uid}", "reason": reason} for uid, reason in self._unpredicted.items()])

    def slice_positions(self, bag_id: str) -> tuple[np.ndarray, str] | None:
        """The positions of a series' slices as served to the model in this process (mm along the
        scan axis, or InstanceNumber): without the slices that could not be decoded, after ``max_slices``."""
        return self._positions.get(bag_id)

    def describe(self, subcommand: str) -> dict[str, Any]:
        series = {uid: folder for uid, folder in self._source.items() if uid not in self._unpredicted}
        return {"class": type(self).__qualname__, "inputs": self.inputs, "series": series, "max_slices": self.max_slices}


def _collate(items: list[dict[str, Any]]) -> tuple[BagBatch, dict[str, tuple[np.ndarray, str]], dict[str, list[tuple[str, str]]]]:
    return (collate_bags(items), {it["bag_id"]: (it["positions"], it["position_axis"]) for it in items},
            {it["bag_id"]: it["skipped"] for it in items})
