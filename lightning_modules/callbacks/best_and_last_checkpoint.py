"""``ModelCheckpoint`` whose ``last.ckpt`` is the latest epoch, as resuming needs."""
from __future__ import annotations

import os
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

__all__ = ["BestAndLastCheckpoint"]


class BestAndLastCheckpoint(ModelCheckpoint):
    """:class:`~pytorch_lightning.callbacks.ModelCheckpoint` that also writes ``last.ckpt`` at every
    checkpointing point where the best model did not improve.

    Lightning 2.6 rewrites ``last.ckpt`` only in a step that saved a top-k checkpoint: with
    ``save_top_k=1`` (``best.ckpt``) ``--ckpt_path last`` would resume from the best epoch.

    A run folder copied or moved elsewhere resumes with its best score (:meth:`load_state_dict`).
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore, with the checkpoint paths of a folder that was moved mapped into
        this one: Lightning drops the best score when the stored folder is not ``dirpath``, and the
        resumed run's next epoch, however worse, became the best. Mapped only when this folder holds
        the stored best checkpoint's file (a copy of the stored folder: ``milgp-train`` resumes
        only from its run folder's own ``checkpoints/``)."""
        stored = state_dict.get("dirpath")
        best = state_dict.get("best_model_path")
        if self.dirpath is None or stored in (None, self.dirpath) or not best or not os.path.isfile(self._moved(best, stored)):
            super().load_state_dict(state_dict)
            return
        paths = {k: self._moved(state_dict[k], stored) for k in ("best_model_path", "kth_best_model_path", "last_model_path") if state_dict.get(k)}
        best_k = {self._moved(p, stored): v for p, v in state_dict.get("best_k_models", {}).items()}
        super().load_state_dict({**state_dict, **paths, "dirpath": self.dirpath, "best_k_models": best_k})

    def _moved(self, path: str, stored_dirpath: str) -> str:
        """``path`` of the stored folder as the same file of this one (other paths unchanged)."""
        if os.path.dirname(path) != os.path.normpath(stored_dirpath):
            return path
        return os.path.join(str(self.dirpath), os.path.basename(path))

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint``'s own key, so that runs checkpointed before this class resume with
        their best score."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_not_saved(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_not_saved(trainer)

    def _save_last_if_not_saved(self, trainer: pl.Trainer) -> None:
        # skipped when this step already wrote a checkpoint (and with it last.ckpt), outside fitting
        # and in the sanity check
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
