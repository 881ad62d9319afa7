"""Worker for test_ddp.py: train the end-to-end GP on tiny image bags with 1 or 2 CPU processes.

Usage: ``python ddp_run.py OUT_DIR DEVICES``. Each rank saves its q(v), model state and the
gathered locals to ``OUT_DIR/devices{D}_rank{R}.pt``. With 2 devices Lightning's DDP strategy
(gloo) re-launches this script for rank 1; each rank gets 2 bags per step, the single process 4,
so every optimisation step sees the same bags (unshuffled shards: rank r gets bags r, r + 2, ...;
the single process gets them in order, 4 per step).
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
from lightning_modules.distributed import all_gather_objects, is_distributed  # noqa: E402
from milgp.data.bags import collate_bags  # noqa: E402

warnings.filterwarnings("ignore")


class SaveState(pl.Callback):
    def __init__(self, out: str, devices: int):
        self.out, self.devices = out, devices

    def on_train_end(self, trainer: pl.Trainer, pl_module: GPMILModule) -> None:
        q = pl_module.gp.posterior()
        merged = {}
        for part in all_gather_objects({k: v.cpu() for k, v in pl_module._locals.items()}):
            merged.update(part)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"m": q.m.cpu(), "S": q.S.cpu(), "state": state, "locals": merged, "steps": int(pl_module.natural_steps)},
                   os.path.join(self.out, f"devices{self.devices}_rank{trainer.global_rank}.pt"))


class ShardedBags(BagArrayDataModule):
    """Unshuffled shards: rank r gets bags r, r + 2, ... (Lightning's own sampler would shuffle)."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ds = self.dataset("train")
        sampler = torch.utils.data.DistributedSampler(ds, shuffle=False) if is_distributed() else None
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_bags)


def main(out: str, devices: int) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    data = image_bags(num_bags=10, size=16, seed=4, max_slices=4)
    dm = ShardedBags(**data, splits=["train"] * 8 + ["val"] * 2, batch_size=4 // devices)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=4, widths=(4, 4)), num_inducing=6,
                        warmup_epochs=0, lr_extractor=1e-2, lr_gp=1e-2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
        limit_val_batches=0, use_distributed_sampler=False, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveState(out, devices)],
    )
    trainer.fit(model, dm)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
