"""A run resumed from a checkpoint continues exactly as the uninterrupted run."""
from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_modules import AttentionMILModule, BagArrayDataModule, GPMILModule, SmallCNN
from lm_helpers import image_bags
from milgp.variational.bag_locals import BagLocals


def _make(kind: str):
    pl.seed_everything(0)
    cnn = SmallCNN(feature_dim=4, widths=(4, 4))
    if kind == "attcnn":
        return AttentionMILModule(cnn, attention_dim=4)
    return GPMILModule(mode="end_to_end", extractor=cnn, num_inducing=6, warmup_epochs=1, lr_extractor=1e-2)


def _fit(kind: str, root: Path, epochs: int, ckpt: str | None = None, shuffle: bool = False):
    data = image_bags(num_bags=8, size=16, seed=5, max_slices=4)
    dm = BagArrayDataModule(**data, splits=["train"] * 6 + ["val"] * 2, batch_size=2, shuffle=shuffle, seed=3)
    model = _make(kind)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, default_root_dir=str(root), logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, save_top_k=-1, every_n_epochs=1)],
    )
    trainer.fit(model, dm, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("kind", ["gp_end_to_end", "attcnn"])
def test_resume_continues_exactly(kind: str, shuffle: bool, tmp_path: Path) -> None:
    """3 epochs straight == 2 epochs, then resume from the checkpoint for the 3rd, with and without shuffling.

    The GP checkpoint must carry q(v) (natural parameters), inducing points, kernel, the
    standardisation statistics, the natural-step counter (Robbins–Monro ρ_t), the per-bag locals
    and Adam's state; if any were missing the resumed third epoch would take a different step.
    With ``shuffle=True`` the third epoch's order must be the same in both runs: it is a function of
    ``(seed, epoch)``; drawn from the global RNG, the resumed run would visit the bags in another order.
    The checkpoint also loads with ``torch.load(weights_only=True)``."""
    straight = _fit(kind, tmp_path / "a", 3, shuffle=shuffle)
    _fit(kind, tmp_path / "b", 2, shuffle=shuffle)
    ckpt = tmp_path / "b" / "ckpt" / "last.ckpt"
    loaded = torch.load(ckpt, weights_only=True)
    assert loaded["epoch"] == 1
    if kind == "gp_end_to_end":
        assert loaded["state_dict"]["bag_locals.sizes"].numel() == 6 and int(loaded["state_dict"]["natural_steps"]) == 6
        assert bool(loaded["state_dict"]["gp.initialized"])
    resumed = _fit(kind, tmp_path / "b", 3, ckpt=str(ckpt), shuffle=shuffle)
    s1, s2 = straight.state_dict(), resumed.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:  # the GP's per-bag locals too (bag_locals.ids / sizes / values)
        torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0, msg=k)


def test_a_checkpoint_with_the_locals_outside_the_state_dict_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the per-bag locals were a module kept them as
    ``checkpoint["gp_locals"]`` (a dict by bag id, no ``bag_locals.*`` entries): resuming from one must
    continue exactly as from a current checkpoint, not fail to load or restart q(y)."""
    straight = _fit("gp_end_to_end", tmp_path / "a", 3)
    _fit("gp_end_to_end", tmp_path / "b", 2)
    ckpt = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=True)
    state = ckpt["state_dict"]
    store = BagLocals()
    store.load_state_dict({k[len("bag_locals."):]: state.pop(k) for k in list(state) if k.startswith("bag_locals.")})
    ckpt["gp_locals"] = {b: store[b] for b in store.ids()}
    torch.save(ckpt, tmp_path / "old.ckpt")
    resumed = _fit("gp_end_to_end", tmp_path / "b", 3, ckpt=str(tmp_path / "old.ckpt"))
    s1, s2 = straight.state_dict(), resumed.state_dict()
    assert s1.keys() == s2.keys() and len(resumed.bag_locals) == 6
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0, msg=k)
