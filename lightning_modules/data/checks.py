"""Checks of a data module's bags before any training work: finite features, usable labels.

Every error is one line naming the file (or source), the bag and the field.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import pytorch_lightning as pl

from lightning_modules.input_error import InputError

__all__ = ["check_bag_ids", "check_bag_labels", "check_features", "check_instance_labels", "check_split_names", "label_kind"]


def label_kind(trainer: pl.Trainer | None) -> str | None:
    """What the attached model needs of bag labels: ``"binary"`` (0/1, MIL classifiers),
    ``"aggregate"`` (real-valued targets: the model's ``is_aggregate``) or ``None`` (no model
    attached: not checked)."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    return None if module is None else "aggregate" if getattr(module, "is_aggregate", False) else "binary"


def check_bag_labels(source: str, bag_ids: Sequence[str], labels: Sequence[float], kind: str | None, required: bool = True) -> None:
    """Every bag label 0 or 1 for a ``"binary"`` model, and finite when ``required`` (the splits a
    run trains or tests on; unlabelled scans are fine to predict)."""
    for bag_id, y in zip(bag_ids, labels):
        y = float(y)
        if not math.isfinite(y):
            if required:
                raise InputError(f"{source}: bag {bag_id!r} has no usable label ({y}); training and testing need every bag labelled")
            continue
        if kind == "binary" and y not in (0.0, 1.0):
            raise InputError(f"{source}: bag {bag_id!r} has label {y:g}; a MIL classifier needs bag labels 0 or 1")


def check_bag_ids(source: str, bag_ids: Sequence[str]) -> None:
    """Every bag id given once: splits, predictions, reports and the GP's per-bag locals are keyed
    by it, so two bags with one id would share them."""
    seen: set[str] = set()
    for bag_id in bag_ids:
        if bag_id in seen:
            raise InputError(f"{source}: bag id {bag_id!r} is given to more than one bag; each scan needs its own id")
        seen.add(bag_id)


def check_features(source: str, bag_ids: Sequence[str], bags: Sequence[np.ndarray]) -> None:
    """Every feature value finite (a NaN would otherwise surface deep inside k-means or a solver)."""
    for bag_id, x in zip(bag_ids, bags):
        x = np.asarray(x)
        bad = np.argwhere(~np.isfinite(x))
        if len(bad):
            row, col = (int(bad[0][0]), int(bad[0][1])) if x.ndim == 2 else (int(bad[0][0]), None)
            field = f"f{col}" if col is not None else "pixels"
            raise InputError(f"{source}: bag {bag_id!r}, slice {row}, field {field} is {x[tuple(bad[0])]} (features must be finite)")


def check_instance_labels(source: str, bag_ids: Sequence[str], instance_labels: Sequence[np.ndarray | None]) -> None:
    """Every known instance label of a MIL classifier's bags 0 or 1 (NaN: unknown)."""
    for bag_id, y in zip(bag_ids, instance_labels):
        if y is None:
            continue
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        bad = np.flatnonzero(~np.isnan(y) & (y != 0.0) & (y != 1.0))
        if len(bad):
            raise InputError(f"{source}: bag {bag_id!r}, slice {int(bad[0])} has instance label {y[bad[0]]:g}; instance labels must be 0, 1 or unknown (NaN)")


_SPLIT_LOOKALIKES = {"training": "train", "validation": "val", "valid": "val", "testing": "test"}


def check_split_names(source: str, bag_ids: Sequence[str], splits: Sequence[str]) -> None:
    """No given split is a misspelt train/val/test (``Train``, ``validation``: refused), and bags
    without a split beside bags with one, which no stage uses, are announced (a warning: e.g. the
    bags outside a cache's ``splits.json``). Other names (``external``) are splits of their own,
    served by ``test_split``."""
    blank = [b for b, s in zip(bag_ids, splits) if s == ""]
    if blank:
        warnings.warn(f"{source}: {len(blank)} bags have no split while the others do (e.g. bag {blank[0]!r}); "
                      "they are used by no stage", UserWarning, stacklevel=2)
    for bag_id, s in zip(bag_ids, splits):
        meant = _SPLIT_LOOKALIKES.get(s.lower(), s.lower())
        if meant in ("train", "val", "test") and s != meant:
            raise InputError(f"{source}: bag {bag_id!r} has split {s!r}; the split names are train, val and test (did you mean {meant!r}?)")
