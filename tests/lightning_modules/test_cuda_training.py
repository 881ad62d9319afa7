"""The Lightning path on a CUDA device (marker ``cuda``; skipped without a GPU, run by hand on a GPU
machine: ``python -m pytest -m cuda tests``): mixed precision keeps the GP head in float64 and
trains, checkpoints move between CUDA and the CPU, and DDP runs on one device."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_modules import AttentionMILModule, BagArrayDataModule, GPMILModule, SmallCNN
from milgp.data.bags import collate_bags
from lm_helpers import feature_bags, image_bags

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class TrainLosses(pl.Callback):
    """The loss of every training step, per epoch."""

    def __init__(self) -> None:
        self.epochs: list[list[float]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append([])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.epochs[-1].append(float(loss))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # while the module is still on the GPU (Lightning moves it back to the CPU at teardown)
        self.gp_tensors = [(t.dtype, t.device.type) for t in pl_module.gp.state_dict().values() if t.is_floating_point()] if hasattr(pl_module, "gp") else []


def _trainer(root: Path, epochs: int, precision: str = "32-true", **kw) -> tuple[pl.Trainer, TrainLosses]:
    losses = TrainLosses()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, precision=precision, max_epochs=epochs, default_root_dir=str(root), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[losses, pl.callbacks.ModelCheckpoint(dirpath=str(root), filename="m", save_top_k=0, save_last=True)], **kw,
    )
    return trainer, losses


def _image_data(seed: int = 3) -> tuple[dict, BagArrayDataModule]:
    data = image_bags(num_bags=24, size=32, seed=seed, max_slices=6)
    return data, BagArrayDataModule(**data, splits=["train"] * 18 + ["val"] * 6, batch_size=6)


def _decreasing(epochs: list[list[float]]) -> bool:
    first, last = np.mean(epochs[0]), np.mean(epochs[-1])
    return all(math.isfinite(v) for e in epochs for v in e) and last < first


def test_end_to_end_gp_under_16_mixed_keeps_the_gp_in_float64_and_trains(tmp_path: Path) -> None:
    """CNN + GP head with ``precision="16-mixed"``: every GP parameter and buffer stays float64 (the
    head runs outside autocast), the losses are finite and fall from the first to the last epoch."""
    pl.seed_everything(0)
    _, dm = _image_data()
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=6, widths=(8, 8)), num_inducing=8, warmup_epochs=0,
                        lr_extractor=1e-2, lr_gp=1e-2)
    trainer, losses = _trainer(tmp_path, 6, "16-mixed")
    trainer.fit(model, dm)
    assert losses.gp_tensors and all(t == (torch.float64, "cuda") for t in losses.gp_tensors), losses.gp_tensors
    assert _decreasing(losses.epochs), losses.epochs


def test_attention_cnn_under_16_mixed_trains(tmp_path: Path) -> None:
    """The AttCNN with ``precision="16-mixed"``: finite losses that fall over the epochs."""
    pl.seed_everything(0)
    _, dm = _image_data()
    model = AttentionMILModule(SmallCNN(feature_dim=8, widths=(8, 8)), attention_dim=8, lr=3e-3)
    trainer, losses = _trainer(tmp_path, 8, "16-mixed")
    trainer.fit(model, dm)
    assert _decreasing(losses.epochs), losses.epochs


@pytest.mark.parametrize("train_on", ["cuda", "cpu"])
def test_a_checkpoint_moves_between_cuda_and_cpu(tmp_path: Path, train_on: str) -> None:
    """A GP checkpoint written on one device loads on the other and predicts the same bag
    probabilities (float32 CNN on two devices: to 1e-4)."""
    pl.seed_everything(0)
    data, dm = _image_data(seed=5)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=5, widths=(4, 6)), num_inducing=6, warmup_epochs=0)
    if train_on == "cuda":
        trainer, _ = _trainer(tmp_path, 2)
    else:
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), filename="m", save_top_k=0, save_last=True)])
    trainer.fit(model, dm)
    batch = collate_bags([(torch.as_tensor(data["bags"][i]), None, data["bag_labels"][i], f"b{i}") for i in range(10)])
    probs = {}
    for device in ("cuda", "cpu"):
        loaded = GPMILModule.load_from_checkpoint(str(tmp_path / "last.ckpt"), map_location=device).eval()
        with torch.no_grad():
            probs[device] = np.array([r["bag_prob"] for r in loaded.predict_records(batch.to(device))])
    assert np.isfinite(probs["cpu"]).all()
    np.testing.assert_allclose(probs["cuda"], probs["cpu"], atol=1e-4)


def test_ddp_on_one_cuda_device_trains_the_two_stage_gp(tmp_path: Path) -> None:
    """``strategy="ddp"`` with one CUDA device (NCCL, world size 1) runs the natural steps'
    all-reduce and fits a two-stage GP head whose training bags are ranked correctly."""
    pl.seed_everything(0)
    data = feature_bags(num_bags=24)
    dm = BagArrayDataModule(**data, splits=["train"] * 18 + ["val"] * 6, batch_size=6)
    model = GPMILModule(feature_dim=4, num_inducing=8, warmup_epochs=1)
    trainer, _ = _trainer(tmp_path, 4, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(model, dm)
    batch = collate_bags([(torch.as_tensor(data["bags"][i]), None, data["bag_labels"][i], f"b{i}") for i in range(24)])
    with torch.no_grad():
        p = np.array([r["bag_prob"] for r in model.eval().predict_records(batch.to(model.device))])
    y = np.array(data["bag_labels"])
    assert np.isfinite(p).all() and p[y == 1].mean() > p[y == 0].mean()


def test_the_ct_cache_loader_pins_batches_on_a_gpu_machine_and_they_copy_without_blocking(tiny_cache: str) -> None:
    """With a GPU present the CT data module pins its batches (``pin_memory=None``) and the
    modules copy them with ``non_blocking=True``; otherwise the copy to the GPU would wait for every
    queued kernel and the loader's pages would be copied twice. The copy must equal the batch."""
    from lightning_modules import CTCacheDataModule

    dm = CTCacheDataModule(tiny_cache, batch_size=2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert dm.pin_memory and loader.pin_memory
    batch = next(iter(loader))
    assert batch.x.is_pinned() and batch.bag_index.is_pinned() and batch.bag_labels.is_pinned()
    moved = AttentionMILModule(SmallCNN(feature_dim=8, widths=(4, 8))).transfer_batch_to_device(batch, torch.device("cuda"), 0)
    torch.cuda.synchronize()
    assert moved.x.device.type == "cuda"
    torch.testing.assert_close(moved.x.cpu(), batch.x)
    torch.testing.assert_close(moved.bag_index.cpu(), batch.bag_index)
