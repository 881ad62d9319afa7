"""The run folder: every output of ``milgp-train`` and ``milgp-predict`` lives under one folder;
its layout and rules (one training history per folder, a resumed fit continuing the earlier
``metrics.csv``) are in docs/lightning.md ("The run folder").
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from lightning_fabric.loggers.csv_logs import _ExperimentWriter
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from lightning_modules.checkpoints import read_checkpoint
from lightning_modules.input_error import InputError

__all__ = ["RunFolder", "RunLogger"]

_VERSION = re.compile(r"^version_(\d+)$")


class RunFolder:
    """Paths and rules of one run folder (docs/lightning.md, "The run folder").

    Args:
        root: the folder (``trainer.default_root_dir``).
    """

    CHECKPOINT_ALIASES = ("best", "last")

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.created: list[Path] = []

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    def versions(self, subcommand: str) -> list[int]:
        folder = self.root / subcommand
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _VERSION.match(p.name)) and p.is_dir())

    def resolve_checkpoint(self, ckpt_path: str | None) -> str | None:
        """``"best"``/``"last"`` → this folder's ``checkpoints/<alias>.ckpt``; any path must exist."""
        if ckpt_path is None:
            return None
        path = self.checkpoint_dir / f"{ckpt_path}.ckpt" if ckpt_path in self.CHECKPOINT_ALIASES else Path(ckpt_path)
        if not path.is_file():
            raise InputError(f"--ckpt_path {ckpt_path}: no checkpoint at {path}")
        return str(path)

    def check_evaluation(self, subcommand: str, ckpt_path: str | None) -> None:
        """Refuse ``validate``, ``test`` or ``predict`` without a checkpoint: the config's model is
        untrained (a GP head not even set up), and its report would sit beside the real ones."""
        if ckpt_path is not None:
            return
        existing = sorted(p.stem for p in self.checkpoint_dir.glob("*.ckpt")) if self.checkpoint_dir.is_dir() else []
        where = f"this run folder's --ckpt_path {'|'.join(existing)}" if existing else "--ckpt_path PATH of a trained model"
        raise InputError(f"{subcommand} without a checkpoint would evaluate the untrained model of the config: give {where}")

    def check_fit(self, ckpt_path: str | None) -> tuple[Path | None, int | None]:
        """Refuse a fit that would mix two runs in this folder; for a resumed fit return the
        ``metrics.csv`` to continue and the checkpoint's epoch (``(None, None)`` otherwise)."""
        existing = sorted(self.checkpoint_dir.glob("*.ckpt")) if self.checkpoint_dir.is_dir() else []
        if not existing:
            return None, None
        names = ", ".join(p.name for p in existing)
        if ckpt_path is None:
            raise InputError(
                f"{self.root} holds a fit already (checkpoints/{names}): resume it with --ckpt_path last, "
                "or give another run folder (--trainer.default_root_dir)"
            )
        if Path(ckpt_path).resolve().parent != self.checkpoint_dir.resolve():
            raise InputError(
                f"{self.root} holds a fit already (checkpoints/{names}): fitting from {ckpt_path} there would mix two runs' "
                "checkpoints; give another run folder (--trainer.default_root_dir)"
            )
        versions = self.versions("fit")
        history = self.root / "fit" / f"version_{versions[-1]}" / "metrics.csv" if versions else None
        epoch = int(read_checkpoint(ckpt_path).get("epoch", -1))
        return (history if history is not None and history.is_file() else None), epoch

    def claim_version(self, subcommand: str) -> int:
        """Create ``<subcommand>/version_<n>`` for the next free ``n`` and return ``n``. The folder is
        made with ``os.mkdir``, which fails when it exists, so two commands running at once into
        this folder never get the same version (the later one takes the next number). The folders
        above it that this call creates (``<subcommand>``, the run folder) are in :attr:`created`,
        deepest first, for :meth:`RunLogger.discard_unwritten`."""
        parent = self.root / subcommand
        self.created = [p for p in (parent, *parent.parents) if not p.exists()]
        version = max(self.versions(subcommand), default=-1) + 1
        while True:
            try:
                parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(parent / f"version_{version}")
                return version
            except (FileExistsError, NotADirectoryError):
                if parent.is_dir():  # the version was taken
                    version += 1
                    continue
                file = next(p for p in (parent, *parent.parents) if p.exists() and not p.is_dir())
                raise InputError(f"{file} is a file, not a folder: the run's outputs go into {parent}/version_<n>") from None
            except FileNotFoundError:  # another command's discard removed an empty folder above it just now
                continue

    def logger(self, subcommand: str, history: Path | None = None, until_epoch: int | None = None) -> "RunLogger":
        """The CSV logger of a new version of ``subcommand`` (continuing ``history``), claimed when
        the trainer first asks for it (:meth:`claim_version`)."""
        return RunLogger(self, subcommand, history, until_epoch)


class _RunExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer that never deletes a metrics file and may start from earlier rows."""

    def __init__(self, log_dir: str, history: Path | None, until_epoch: int | None):
        super().__init__(log_dir)
        self.copied_size: int | None = None  # the size of the history copy, until a row is written
        if history is None:
            return
        with open(history, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            header = list(reader.fieldnames or [])
            rows = [r for r in reader if until_epoch is None or not r.get("epoch") or float(r["epoch"]) <= until_epoch]
        with open(self.metrics_file_path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
        self.metrics_keys = sorted(header)
        self.copied_size = os.path.getsize(self.metrics_file_path)

    def _check_log_dir_exists(self) -> None:
        """Lightning deletes an existing ``metrics.csv`` here; a run folder's versions are new, and
        the continued history must stay."""


class RunLogger(CSVLogger):
    """``CSVLogger`` writing ``<run folder>/<name>/version_<n>/metrics.csv``, optionally starting
    with the rows of an earlier ``metrics.csv`` up to epoch ``until_epoch`` (a resumed fit).

    The version is claimed (:meth:`RunFolder.claim_version`) on rank 0 when first asked for; the
    other ranks of a DDP run write nothing and take the latest version.

    Args:
        folder: the run folder.
        name: the subcommand.
        history: an earlier ``metrics.csv`` to continue.
        until_epoch: keep its rows of epochs up to this one (the resumed checkpoint's epoch).
    """

    def __init__(self, folder: RunFolder, name: str, history: Path | None = None, until_epoch: int | None = None):
        super().__init__(str(folder.root), name=name)
        self._folder = folder
        self._history = history
        self._until_epoch = until_epoch
        self._claimed: Path | None = None

    def _get_next_version(self) -> int:
        if rank_zero_only.rank != 0:
            return max(self._folder.versions(self.name), default=0)
        version = self._folder.claim_version(self.name)
        self._claimed = Path(self.root_dir) / f"version_{version}"
        return version

    UNWRITTEN = ("hparams.yaml", "config.yaml")
    """What a version folder holds before a command has written any output: the logger's
    hyperparameters and the CLI's copy of the config."""

    def _unwritten(self, path: Path) -> bool:
        """Whether ``path`` in the claimed folder is no output of this command: :attr:`UNWRITTEN`, or
        the copy of a resumed fit's history (``metrics.csv``) that no row has been added to."""
        copied = getattr(self._experiment, "copied_size", None)
        return path.name in self.UNWRITTEN or (path.name == "metrics.csv" and copied is not None and path.stat().st_size == copied)

    def discard_unwritten(self) -> None:
        """Remove the version folder this logger claimed when it holds nothing but what
        :meth:`_unwritten` allows (a command refused before it wrote anything, a resume refused over
        its data), then the folders above it that the claim created (``<subcommand>/``, a new run
        folder) when they are empty; a folder with any other file stays."""
        if self._claimed is None or not self._claimed.is_dir() or not all(self._unwritten(p) for p in self._claimed.iterdir()):
            return
        for path in list(self._claimed.iterdir()):
            path.unlink()
        self._claimed.rmdir()
        self._claimed = None
        for folder in self._folder.created:  # deepest first; rmdir refuses a folder that is not empty
            try:
                folder.rmdir()
            except OSError:
                break

    @property
    @rank_zero_experiment
    def experiment(self) -> _ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _RunExperimentWriter(self.log_dir, self._history, self._until_epoch)
        return self._experiment
