"""``ModelCheckpoint`` whose ``last.ckpt`` is the latest epoch, as resuming needs."""
from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

__all__ = ["BestAndLastCheckpoint"]


class BestAndLastCheckpoint(ModelCheckpoint):
    """:class:`~pytorch_lightning.callbacks.ModelCheckpoint` that also writes ``last.ckpt`` at every
    checkpointing point where the best model did not improve.

    Lightning 2.6 rewrites ``last.ckpt`` only in a step that saved a top-k checkpoint: with
    ``save_top_k=1`` (``best.ckpt``) ``--ckpt_path last`` would resume from the best epoch.
    """

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
