"""Worker for test_ddp.py: train the end-to-end GP on tiny image bags with 1 or 2 CPU processes.

Usage: ``python ddp_run.py OUT_DIR DEVICES [shuffle]``. Each rank saves its q(v), model state and
its locals to ``OUT_DIR/devices{D}[_shuffle]_rank{R}.pt``. With 2 devices Lightning's DDP strategy
(gloo) re-launches this script for rank 1; each rank gets 2 bags per step, the single process 4,
so every optimisation step sees the same bags: the data module's ``EpochSampler`` gives rank r
positions r, r + 2, ... of one order per epoch (dataset order, or a permutation seeded by the
epoch with ``shuffle``), and the single process the same order, 4 per step.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytorch_lightning as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_helpers import image_bags  # noqa: E402

from lightning_modules import BagArrayDataModule, GPMILModule, SmallCNN  # noqa: E402
from lightning_modules.distributed import end_process_group  # noqa: E402

warnings.filterwarnings("ignore")


class SaveState(pl.Callback):
    def __init__(self, out: str, name: str):
        self.out, self.name = out, name

    def on_train_end(self, trainer: pl.Trainer, pl_module: GPMILModule) -> None:
        q = pl_module.gp.posterior()
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"m": q.m.cpu(), "S": q.S.cpu(), "state": state, "locals": {b: pl_module.bag_locals[b] for b in pl_module.bag_locals.ids()}, "steps": int(pl_module.natural_steps)},
                   os.path.join(self.out, f"{self.name}_rank{trainer.global_rank}.pt"))


def main(out: str, devices: int, shuffle: bool) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    data = image_bags(num_bags=10, size=16, seed=4, max_slices=4)
    dm = BagArrayDataModule(**data, splits=["train"] * 8 + ["val"] * 2, batch_size=4 // devices, shuffle=shuffle)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=4, widths=(4, 4)), num_inducing=6,
                        warmup_epochs=0, lr_extractor=1e-2, lr_gp=1e-2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
        limit_val_batches=0, use_distributed_sampler=False, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveState(out, f"devices{devices}" + ("_shuffle" if shuffle else ""))],
    )
    trainer.fit(model, dm)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "shuffle")
