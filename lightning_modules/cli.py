"""``milgp-train``: the Lightning CLI (``fit``, ``validate``, ``test``, ``predict``) for milgp.

Models and data modules are chosen in YAML with ``class_path``/``init_args`` (short class names
work for everything in :mod:`lightning_modules`)::

    milgp-train fit --config configs/rsna_attcnn.yaml
    milgp-train predict --config configs/rsna_attcnn.yaml --ckpt_path runs/rsna/attcnn/checkpoints/last.ckpt
    milgp-train fit --config configs/rsna_gp_two_stage.yaml
    milgp-train test --config configs/rsna_gp_two_stage.yaml --ckpt_path .../last.ckpt
    milgp-train fit --config configs/demo_attcnn.yaml --print_config

Any value can be overridden on the command line (``--trainer.max_epochs 3``,
``--model.init_args.likelihood.init_args.psi gamma``). Also runs as ``python -m lightning_modules.cli``.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

import lightning_modules  # noqa: F401  (registers the classes for short class_path names)
from lightning_modules.bag_module_base import BagModuleBase

__all__ = ["MilgpCLI", "main", "run_cli"]


class MilgpCLI(LightningCLI):
    """LightningCLI with milgp's model/data base classes in subclass mode."""


def run_cli(args: Sequence[str] | dict[str, Any] | None = None, run: bool = True) -> MilgpCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line (``None``: ``sys.argv``)."""
    if args is not None:  # called from Python: the host program's own argv is not for us
        saved, sys.argv = sys.argv, sys.argv[:1]
        try:
            return _make(args, run)
        finally:
            sys.argv = saved
    return _make(args, run)


def _make(args: Sequence[str] | dict[str, Any] | None, run: bool) -> MilgpCLI:
    return MilgpCLI(
        BagModuleBase,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=list(args) if isinstance(args, (list, tuple)) else args,
        run=run,
    )


def main(args: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns 0 (errors exit non-zero via the parser or raise)."""
    run_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
