"""Quiet command-line entry points: known dependency warnings and Lightning's tips silenced.

Called by ``milgp-train``, ``milgp-predict`` and the demo only (importing the package changes no
warning filter or logger). Each entry below is a known, harmless message.
"""
from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["quiet_entry_point"]

_WARNINGS = (
    r".*torch\.jit\.script.* is deprecated.*",  # raised inside torchvision and Lightning imports
    r".*does not have many workers.*",  # small data, num_workers: 0 on purpose
    # a model overriding transfer_batch_to_device used with a data module: the bag batch moves itself
    r".*overridden `transfer_batch_to_device`.*",
    r".*module\(s\) in eval mode.*",  # at the start of training: a two-stage GP's frozen CNN
    # a resumed fit (the run folder refuses any other fit into a used folder)
    r".*Checkpoint directory .* exists and is not empty.*",
    # the training callbacks when predicting from a checkpoint: prediction needs none of them
    r".*Be aware that when using `ckpt_path`, callbacks used to create the checkpoint.*",
    r".*LeafSpec.*",  # PyTorch's deprecation inside Lightning
    # DICOM folders are read as an iterable dataset; the prediction writer needs no batch indices
    r".*Couldn't infer the batch indices fetched from your dataloader.*",
)
# Lightning's log lines advertising other packages and the TPU/HPU summary lines of a machine
# without them (the GPU line stays)
_LOG_LINES = re.compile(r"💡 Tip|^(TPU|HPU) available")


def _drop_known_lines(record: logging.LogRecord) -> bool:
    return not _LOG_LINES.search(record.getMessage())


def quiet_entry_point() -> None:
    """Install the filters (module docstring) for the rest of the process."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # about the way Lightning's CLI calls it
    import pytorch_lightning  # noqa: F401  (sets up its logger; the filter goes on its handlers)

    for name in ("pytorch_lightning", "lightning_fabric", ""):
        for handler in logging.getLogger(name).handlers:
            if _drop_known_lines not in handler.filters:
                handler.addFilter(_drop_known_lines)
