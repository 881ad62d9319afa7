"""AttentionMILModule's bag probabilities: calibrated on the validation bags, in the checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_modules import AttentionMILModule, BagArrayDataModule
from lightning_modules.input_error import InputError
from lm_helpers import feature_bags
from milgp.data.bags import collate_bags
from milgp.metrics import log_loss
from milgp.prediction import BagCalibrator, cross_fitted_calibration


def _trained(root: Path) -> tuple[AttentionMILModule, BagArrayDataModule, pl.Trainer]:
    pl.seed_everything(0, workers=True)
    data = feature_bags(num_bags=40, dim=32, seed=1)  # the default extractor's 32 features
    dm = BagArrayDataModule(**data, splits=["train"] * 24 + ["val"] * 16, batch_size=8)
    module = AttentionMILModule(attention_dim=8, lr=1e-2)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=4, default_root_dir=str(root), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=2)
    trainer.fit(module, dm)
    return module, dm, trainer


def _val_scores(module: AttentionMILModule, dm: BagArrayDataModule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = next(iter(torch.utils.data.DataLoader(dm.dataset("val"), batch_size=100, collate_fn=collate_bags)))
    module.eval()
    with torch.no_grad():
        logits = module(batch.x, batch.bags)["logits"].double()
    return batch.x, torch.sigmoid(logits), batch.bag_labels.double()


def test_validation_fits_the_calibration_and_logs_a_cross_fitted_nll(tmp_path: Path) -> None:
    """After a validation epoch the module predicts σ(logit) through a Platt calibration fitted on
    the validation bags (without it, a network trained by cross-entropy on a few hundred scans
    predicts ≈ ½ for every scan); the logged bag NLL is that of calibrations fitted on the other
    half of the bags, not of the calibration fitted on the bags it scores. ``validate`` on a trained
    module scores its calibration and never refits it (a checkpoint must predict as it was saved)."""
    module, dm, trainer = _trained(tmp_path)
    assert bool(module.calibrator.fitted)
    _, scores, labels = _val_scores(module, dm)
    expected = BagCalibrator().fit(scores, labels)
    assert float(module.calibrator.slope) == pytest.approx(float(expected.slope), rel=1e-4)
    assert module.val_metrics["bag_nll"] == pytest.approx(log_loss(cross_fitted_calibration(scores, labels), labels), rel=1e-4)
    records = {r["bag_id"]: r for r in module.val_records}
    batch = collate_bags([dm.dataset("val")[i] for i in range(len(dm.dataset("val")))])
    predicted = module.predict_records(batch)
    for r in predicted:
        assert r["bag_prob"] == pytest.approx(float(module.calibrator(torch.tensor([r["bag_score"]]))[0]), abs=1e-6)
        assert r["bag_prob"] == pytest.approx(records[r["bag_id"]]["bag_prob"], abs=1e-5)
    module.calibrator.fit(scores[:8].flip(0), labels[:8])  # any other calibration: validate must keep it
    kept = {k: v.clone() for k, v in module.calibrator.state_dict().items()}
    trainer.validate(module, dm, verbose=False)
    assert all(torch.equal(v, module.calibrator.state_dict()[k]) for k, v in kept.items())


def test_a_checkpoint_without_a_calibration_loads_as_uncalibrated() -> None:
    """A state dict written before the module had a calibration (a user's older checkpoint) loads
    and predicts σ(logit); a state dict missing any other entry is still refused by name."""
    module = AttentionMILModule(attention_dim=8)
    module.calibrator.fit(torch.tensor([0.2, 0.4, 0.6, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    old = {k: v for k, v in module.state_dict().items() if not k.startswith("calibrator.")}
    fresh = AttentionMILModule(attention_dim=8)
    fresh.load_state_dict(old)
    assert not bool(fresh.calibrator.fitted)
    p = torch.tensor([0.3, 0.7])
    assert torch.equal(fresh.calibrator(p)[0], p)
    with pytest.raises(InputError, match="'classifier.bias' is missing there"):
        fresh.load_state_dict({k: v for k, v in old.items() if k != "classifier.bias"})


@pytest.mark.parametrize("hook", ["on_test_start", "on_predict_start", "on_validation_start"])
def test_scoring_data_of_other_ct_preprocessing_is_refused(hook: str) -> None:
    """`test`, `validate` and `predict` on a cache built with other windows than the model's were
    scored without a word (only `fit` checked): the model must refuse in one line naming both
    preprocessings, and accept its own (feature inputs have none to check)."""
    from types import SimpleNamespace

    from lightning_modules.input_error import InputError

    module = AttentionMILModule(attention_dim=8)
    module.input_preprocessing = {"windows": [[40.0, 80.0]], "size": [32, 32], "dtype": "uint8"}
    state = SimpleNamespace(fn="validate" if hook == "on_validation_start" else "test")

    def attach(preprocessing):
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(preprocessing=preprocessing), state=state)

    attach({"windows": [[50.0, 100.0]], "size": [32, 32], "dtype": "uint8"})
    with pytest.raises(InputError, match=r"trained on CT slices preprocessed as .*windows.*40\.0.*but the \w+ data are .*50\.0"):
        getattr(module, hook)()
    for same in ({"windows": [[40.0, 80.0]], "size": [32, 32], "dtype": "float16"}, None):
        attach(same)
        getattr(module, hook)()
