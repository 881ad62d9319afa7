"""``milgp-predict CHECKPOINT INPUT...``: predictions for new scans from a checkpoint alone.

INPUT is one or more DICOM folders (every CT series found under them is one scan), one CT cache
(a ``milgp-cache`` folder: all its scans) or one feature file (``.npz``/``.csv`` in any case: all its bags).
The checkpoint brings everything else: the model and its extractor, the CT windows and slice size
of its training data, the feature standardisation, the bag rule and its calibration. The outputs
(:class:`lightning_modules.callbacks.PredictionWriter`) go to a new ``predict/version_<n>`` folder of
the checkpoint's run folder (or of ``--out``). Also ``python -m lightning_modules.predict``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["build_parser", "check_accelerator", "data_module_for", "main", "predict"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="milgp-predict", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                     epilog="Outputs: predictions.csv, slices.csv, predictions.json, scans/<id>.png.")
    parser.add_argument("checkpoint", help="a checkpoint written by milgp-train (e.g. <run>/checkpoints/best.ckpt)")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="DICOM folders, or one CT cache folder, or one feature file")
    parser.add_argument("--out", help="run folder to write predict/version_<n>/ into (default: the checkpoint's run folder)")
    parser.add_argument("--max-slices", type=int, default=None, help="keep at most this many evenly spaced slices per scan (default: all)")
    parser.add_argument("--batch-size", type=int, default=1, help="scans per batch (default 1)")
    parser.add_argument("--threshold", type=float, default=0.5, help="decision threshold of the calibrated probability (default 0.5)")
    parser.add_argument("--no-plots", action="store_true", help="no per-scan PNG")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default auto)")
    return parser


def data_module_for(inputs: Sequence[str], max_slices: int | None = None, batch_size: int = 1) -> Any:
    """The data module serving ``inputs`` whole: a feature file, a CT cache, or DICOM folders."""
    from lightning_modules.data import CTCacheDataModule, DicomDataModule, FeatureDataModule
    from lightning_modules.input_error import InputError

    paths = [Path(p) for p in inputs]
    if any(p.suffix.lower() in (".npz", ".csv") for p in paths):  # X.NPZ too
        if len(paths) > 1:
            raise InputError(f"give one feature file, not {len(paths)} inputs")
        return FeatureDataModule(str(paths[0]), predict_split="all", eval_batch_size=batch_size)
    files = [p for p in paths if p.exists() and not p.is_dir()]
    if files:
        raise InputError(f"{files[0]}: not a feature file (.npz or .csv) or a DICOM folder")
    if any((p / "params.json").is_file() for p in paths):
        if len(paths) > 1:
            raise InputError(f"give one CT cache folder, not {len(paths)} inputs")
        return CTCacheDataModule(str(paths[0]), predict_split="all", eval_batch_size=batch_size, max_slices=max_slices)
    return DicomDataModule([str(p) for p in paths], max_slices=max_slices, eval_batch_size=batch_size)


def predict(
    checkpoint: str | Path,
    inputs: Sequence[str],
    out: str | Path | None = None,
    max_slices: int | None = None,
    batch_size: int = 1,
    threshold: float = 0.5,
    plots: bool = True,
    accelerator: str = "auto",
    progress: bool = True,
) -> Path:
    """Predict ``inputs`` with the model of ``checkpoint``; returns the version folder written.
    Settings out of range are refused (:class:`~lightning_modules.input_error.InputError`) before
    anything is read or written."""
    from lightning_modules.input_error import InputError
    from lightning_modules.setting_checks import check_at_least

    if not 0.0 < threshold < 1.0:
        raise InputError(f"--threshold must lie in (0, 1), got {threshold:g}")
    check_at_least("--max-slices", max_slices, 1, " (or left out for every slice)", InputError)
    check_at_least("--batch-size", batch_size, 1, error=InputError)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"--out {out}: a file, not a run folder")
    check_accelerator(accelerator)
    import pytorch_lightning as pl

    from lightning_modules.callbacks import PredictionWriter
    from lightning_modules.checkpoints import load_module
    from lightning_modules.run_folder import RunFolder

    model = load_module(checkpoint)
    data = data_module_for(inputs, max_slices, batch_size)
    parent = Path(checkpoint).resolve().parent  # <run>/checkpoints/x.ckpt belongs to <run>
    folder = RunFolder(out if out is not None else parent.parent if parent.name == "checkpoints" else parent)
    logger = folder.logger("predict")
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, default_root_dir=str(folder.root), logger=logger,
        callbacks=[PredictionWriter(threshold=threshold, plots=plots)], enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=progress,
    )
    try:
        trainer.predict(model, datamodule=data, ckpt_path=str(checkpoint))
    except BaseException:
        logger.discard_unwritten()  # the inputs are checked once the model is in place: a refusal writes nothing
        raise
    return Path(trainer.log_dir)


def check_accelerator(accelerator: str) -> None:
    """Refuse an ``--accelerator`` that is not cpu, gpu (cuda) or auto, and a GPU that is not there."""
    from lightning_modules.input_error import InputError

    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise InputError(f"--accelerator {accelerator}: give cpu, gpu or auto")
    import torch

    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise InputError(f"--accelerator {accelerator}: this machine has no GPU that torch can use; give cpu or auto")


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    from lightning_modules.input_error import run_reporting_input_errors

    return run_reporting_input_errors("milgp-predict", lambda: predict(
        args.checkpoint, args.inputs, args.out, args.max_slices, args.batch_size, args.threshold, not args.no_plots, args.accelerator))


if __name__ == "__main__":
    sys.exit(main())
