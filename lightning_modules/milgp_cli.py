"""The LightningCLI behind ``milgp-train``: run folder, checkpoints, reports and predictions."""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

# the modules' classes are imported so that class_path names resolve and subclasses are found
from lightning_modules.attention_mil import AttentionMILModule  # noqa: F401
from lightning_modules.bag_module_base import BagModuleBase
from lightning_modules.callbacks import BestAndLastCheckpoint, FeatureWriter, PredictionWriter, ReportWriter  # noqa: F401
from lightning_modules.checkpoints import check_checkpoint_model
from lightning_modules.data import BagArrayDataModule, CTCacheDataModule, DicomDataModule, FeatureDataModule  # noqa: F401
from lightning_modules.distributed import end_process_group
from lightning_modules.gp_mil import GPMILModule  # noqa: F401
from lightning_modules.input_error import InputError
from lightning_modules.run_folder import RunFolder

__all__ = ["MilgpCLI"]


def _checkpoint_dir(root: str | None) -> str | None:
    return None if not root else str(RunFolder(root).checkpoint_dir)


_GENERIC = ("Does not validate against any of the Union subtypes", "Expected a", "Import path ", "Problem with given class_path")
"""The starts of jsonargparse's own lines in a list of tried types (not a constructor's message)."""


def _constructor_message(err: ValueError) -> str:
    """The constructor's own message in a jsonargparse error, which lists, for an optional class
    argument, every type it tried (``Errors:`` then ``- <message>`` lines, nested one level deeper
    for each class argument inside another, e.g. the likelihood inside the model)."""
    lines = str(err).strip().splitlines()
    tried = [line.strip()[2:] for line in lines if line.lstrip().startswith("- ")]
    own = [t for t in tried if not t.startswith(_GENERIC)]
    if own:
        return own[0]
    return lines[0] if lines else type(err).__name__


class MilgpCLI(LightningCLI):
    """LightningCLI with milgp's model/data base classes in subclass mode, every output under the run
    folder (:mod:`lightning_modules.run_folder`, checked right after parsing), and the groups
    ``checkpoint``, ``report`` and ``prediction`` (docs/lightning.md, "CLI")."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(BestAndLastCheckpoint, "checkpoint")
        monitor, mode = BagModuleBase.selection_metric
        parser.set_defaults({"checkpoint.filename": "best", "checkpoint.monitor": monitor, "checkpoint.mode": mode,
                             "checkpoint.save_last": True, "checkpoint.save_top_k": 1, "checkpoint.enable_version_counter": False})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        parser.add_lightning_class_args(ReportWriter, "report")
        parser.add_lightning_class_args(PredictionWriter, "prediction")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        cfg = self.config[subcommand]
        root = cfg.trainer.default_root_dir
        if not root:
            raise InputError("give the run folder with --trainer.default_root_dir DIR (or in the config): every output goes under it")
        self.run_folder = RunFolder(root)
        cfg.ckpt_path = self.run_folder.resolve_checkpoint(cfg.get("ckpt_path"))
        model = cfg.get("model")
        if cfg.ckpt_path is not None and model is not None:  # Lightning would replace the config's model by the checkpoint's
            check_checkpoint_model(cfg.ckpt_path, model.class_path, (model.get("init_args") or {}).get("mode"))
        if subcommand != "fit":
            self.run_folder.check_evaluation(subcommand, cfg.ckpt_path)
        self._history = self.run_folder.check_fit(cfg.ckpt_path) if subcommand == "fit" else (None, None)
        trained, max_epochs = self._history[1], cfg.trainer.get("max_epochs")
        if trained is not None and max_epochs not in (None, -1) and trained + 1 >= max_epochs:
            raise InputError(
                f"--trainer.max_epochs {max_epochs}: {cfg.ckpt_path} has trained {trained + 1} epochs already; "
                "give more epochs to resume it (it would train none)"
            )

    def instantiate_classes(self) -> None:
        """Build the classes; a constructor's argument check (``ValueError``) is bad input."""
        try:
            super().instantiate_classes()
        except InputError:
            raise
        except ValueError as err:
            raise InputError(_constructor_message(err)) from err

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """The trainer with the run folder's logger first (extra configured loggers after it)."""
        configured = self._get(self.config_init, "trainer", default={}).get("logger")
        extra = [] if configured in (None, True, False) else list(configured) if isinstance(configured, (list, tuple)) else [configured]
        self.run_logger = self.run_folder.logger(self.subcommand, *self._history)
        return super().instantiate_trainer(logger=[self.run_logger, *extra], **kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a command that fails before writing any output (bad data found in ``setup``)
        leaves no version folder behind (:meth:`RunLogger.discard_unwritten`). Under DDP the ranks
        end together and the process group is destroyed (:func:`end_process_group`)."""
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            self.run_logger.discard_unwritten()
            raise
        end_process_group()


def make_cli(args: list[str] | None) -> MilgpCLI:
    """Build and run the CLI over milgp's modules (``args`` as on the command line)."""
    return MilgpCLI(BagModuleBase, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                    auto_configure_optimizers=False, args=args)
