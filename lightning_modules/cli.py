"""``milgp-train``: the Lightning CLI (``fit``, ``validate``, ``test``, ``predict``) for milgp.

:data:`HELP` (``milgp-train --help``, answered without importing torch) has the subcommands and
examples, docs/lightning.md ("CLI", "Bad input") the run folder and the one-line errors. Any value
can be overridden on the command line (``--trainer.max_epochs 3``,
``--model.init_args.likelihood.init_args.psi gamma``). Also runs as ``python -m lightning_modules.cli``.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["HELP", "main", "run_cli"]

HELP = """usage: milgp-train [-h] {fit,validate,test,predict} [-c CONFIG] [--print_config] [--ckpt_path PATH] [...]

Train and evaluate milgp's bag classifiers (AttCNN, GP-MIL two-stage or end to end) with the
Lightning CLI; models, data and trainer are set in YAML (class_path/init_args) or on the command line.

subcommands:
  fit        train; writes <run>/checkpoints/{best,last}.ckpt and <run>/fit/version_<n>/
  validate   evaluate on the validation split; <run>/validate/version_<n>/
  test       evaluate on the test split; <run>/test/version_<n>/ (metrics, predictions, plots)
  predict    predictions for scans (DICOM folders, a cache, a feature file); <run>/predict/version_<n>/

the run folder is --trainer.default_root_dir; --ckpt_path best|last names its checkpoints
(validate, test and predict need one).
A fit into a folder that holds one already must resume it (--ckpt_path last).

examples:
  milgp-train fit  --config configs/demo_attcnn.yaml
  milgp-train test --config configs/demo_attcnn.yaml --ckpt_path best
  milgp-train fit  --config configs/demo_attcnn.yaml --print_config
  milgp-predict runs/demo/gp_two_stage/checkpoints/best.ckpt path/to/dicom_study

milgp-train SUBCOMMAND --help lists every option of the modules and the trainer."""


def run_cli(args: Sequence[str] | None = None) -> Any:
    """Build and run the CLI; ``args`` as on the command line (``None``: ``sys.argv``).
    Returns the :class:`~lightning_modules.milgp_cli.MilgpCLI` (trainer, model, data)."""
    from lightning_modules.milgp_cli import make_cli  # Lightning only from here on

    if args is not None:  # called from Python: the host program's own argv is not for us
        saved, sys.argv = sys.argv, sys.argv[:1]
        try:
            return make_cli(list(args))
        finally:
            sys.argv = saved
    return make_cli(None)


def main(args: Sequence[str] | None = None) -> int:
    """Console-script entry point: 0 on success, 2 on bad input (one line on stderr)."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    from lightning_modules.input_error import run_reporting_input_errors

    # from the command line the CLI reads sys.argv itself and leaves it whole: Lightning starts the
    # other DDP ranks with the same command (given the arguments, run_cli would empty it)
    return run_reporting_input_errors("milgp-train", lambda: run_cli(None if args is None else argv))


if __name__ == "__main__":
    sys.exit(main())
