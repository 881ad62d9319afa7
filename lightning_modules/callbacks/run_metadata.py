"""What the report and prediction writers share: what every file records about its run (model,
checkpoint, data, folder), slice positions and CSV text."""
from __future__ import annotations

import csv
import io
import math
from typing import Any, Sequence

from pathlib import Path

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

__all__ = ["csv_text", "finite_or_none", "output_folder", "run_metadata", "slice_positions"]


def output_folder(trainer: pl.Trainer) -> Path:
    """The run's version folder, where the writers write (``<run>/<subcommand>/version_<n>``): the
    first logger's folder, as ``trainer.log_dir`` has it but without its broadcast, a collective
    that the writers, running on rank 0 alone under DDP, would wait on forever."""
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is None:
        return Path(trainer.default_root_dir)
    return Path(logger.log_dir if isinstance(logger, (CSVLogger, TensorBoardLogger)) else logger.save_dir)


def run_metadata(trainer: pl.Trainer, pl_module: pl.LightningModule, subcommand: str) -> dict[str, Any]:
    """``{"subcommand", "run_folder", "output_folder", "model", "checkpoint", "data"}``: the model's
    :meth:`describe`, the checkpoint the weights came from (``None``: the model as trained in this
    process) and the data module's ``describe(subcommand)``."""
    dm = getattr(trainer, "datamodule", None)
    describe_model = getattr(pl_module, "describe", None)
    describe_data = getattr(dm, "describe", None)
    return {
        "subcommand": subcommand,
        "run_folder": str(trainer.default_root_dir),
        "output_folder": str(output_folder(trainer)),
        "model": describe_model() if callable(describe_model) else {"class": type(pl_module).__qualname__},
        "checkpoint": None if trainer.ckpt_path is None else str(trainer.ckpt_path),
        "data": describe_data(subcommand) if callable(describe_data) else {"class": type(dm).__qualname__ if dm else None},
    }


def slice_positions(trainer: pl.Trainer, bag_id: str, num_slices: int) -> tuple[np.ndarray, str]:
    """A scan's slice positions along the scan axis and their axis label, from the data module's
    ``slice_positions`` (``None`` or absent: slice numbers in scan order)."""
    lookup = getattr(getattr(trainer, "datamodule", None), "slice_positions", None)
    found = lookup(bag_id) if callable(lookup) else None
    if found is None or len(found[0]) != num_slices:
        return np.arange(num_slices, dtype=float), "slice (scan order)"
    return np.asarray(found[0], dtype=float), found[1]


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float, ``None`` when it is ``None`` or not finite (a std that is not there)."""
    return None if value is None or not math.isfinite(float(value)) else float(value)


def csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV with ``header``; ``None`` and non-finite floats are written as empty cells, floats with
    full precision."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[_cell(v) for v in row] for row in rows])
    return buf.getvalue()


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return repr(value) if isinstance(value, float) else value
