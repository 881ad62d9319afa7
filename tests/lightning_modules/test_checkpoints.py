"""A checkpoint alone rebuilds and predicts: extractor, likelihood, standardisation, bag decision."""
from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_modules import AttentionMILModule, BagArrayDataModule, GPMILModule, InputError, SmallCNN
from lightning_modules.checkpoints import load_module
from milgp.data.bags import Bags, collate_bags
from milgp.likelihoods import GammaPsi, MILBernoulliLikelihood
from lm_helpers import feature_bags, image_bags


def _trainer(root: Path, epochs: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_epochs=epochs, default_root_dir=str(root), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(root), filename="m", save_top_k=0, save_last=True)])


def _image_data() -> BagArrayDataModule:
    data = image_bags(num_bags=10, size=16, seed=3, max_slices=4)
    return BagArrayDataModule(**data, splits=["train"] * 6 + ["val"] * 4, batch_size=3)


def _batch(data: dict, idx: range | list[int]) -> object:
    return collate_bags([(torch.as_tensor(data["bags"][i]), None, data["bag_labels"][i], f"b{i}") for i in idx])


def test_python_built_models_load_from_their_checkpoint_alone(tmp_path: Path) -> None:
    """An end-to-end G-VGPMIL with a SmallCNN and an AttCNN, both built in Python (modules passed as
    objects), reload with `load_from_checkpoint(path)` and nothing else, and predict exactly as
    before (same extractor architecture, same ψ density, same bag decision).

    Lightning leaves module arguments given as objects out of the saved hyperparameters: the GP
    came back as the default VGPMIL with no extractor (an error end to end), the AttCNN with the
    default CNN width (a raw state_dict error)."""
    gp = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=5, widths=(4, 6)), num_inducing=5, warmup_epochs=0,
                     likelihood=MILBernoulliLikelihood(psi=GammaPsi(alpha=1.0, beta=1.5), H=50.0))
    att = AttentionMILModule(SmallCNN(feature_dim=6, widths=(4, 4)), attention_dim=5)
    data = image_bags(num_bags=10, size=16, seed=3, max_slices=4)
    batch = _batch(data, range(10))
    for name, model in (("gp", gp), ("att", att)):
        _trainer(tmp_path / name, 2).fit(model, _image_data())
        model.eval()
        loaded = type(model).load_from_checkpoint(str(tmp_path / name / "last.ckpt"))
        assert type(load_module(tmp_path / name / "last.ckpt")) is type(model)
        with torch.no_grad():
            before, after = model.predict_records(batch), loaded.eval().predict_records(batch)
        assert [r["bag_prob"] for r in before] == [r["bag_prob"] for r in after]
    assert isinstance(loaded, AttentionMILModule)
    reloaded_gp = GPMILModule.load_from_checkpoint(str(tmp_path / "gp" / "last.ckpt"))
    assert isinstance(reloaded_gp.gp.likelihood.psi, GammaPsi) and reloaded_gp.gp.likelihood.H == 50.0
    assert reloaded_gp.gp.calibrated and reloaded_gp.gp.rule_name == gp.gp.rule_name


def test_extractor_checkpoint_alone_builds_the_extractor(tmp_path: Path) -> None:
    """`GPMILModule(extractor_checkpoint=path)` without an extractor builds the architecture the
    checkpoint records and loads its weights: fine-tuning your own checkpoint needs no
    hand-copied extractor configuration."""
    att = AttentionMILModule(SmallCNN(feature_dim=6, widths=(4, 8)), attention_dim=5)
    _trainer(tmp_path, 1).fit(att, _image_data())
    gp = GPMILModule(mode="end_to_end", extractor_checkpoint=str(tmp_path / "last.ckpt"), num_inducing=4)
    assert gp.extractor.config()["widths"] == [4, 8]
    for k, v in att.extractor.state_dict().items():
        torch.testing.assert_close(gp.extractor.state_dict()[k], v, rtol=0, atol=0)


def test_mismatched_extractor_is_one_line(tmp_path: Path) -> None:
    """A checkpoint loaded into another extractor architecture gives one line naming the first
    tensor that differs, not PyTorch's list of every missing and mismatched key."""
    att = AttentionMILModule(SmallCNN(feature_dim=6, widths=(4, 8)), attention_dim=5)
    _trainer(tmp_path, 1).fit(att, _image_data())
    with pytest.raises(InputError) as err:
        GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=6, widths=(8, 8)), extractor_checkpoint=str(tmp_path / "last.ckpt"))
    assert len(str(err.value).splitlines()) == 1 and "features.0.weight" in str(err.value) and "(4, 3, 3, 3)" in str(err.value)
    with pytest.raises(InputError, match="does not match") as err:
        AttentionMILModule.load_from_checkpoint(str(tmp_path / "last.ckpt"), extractor=SmallCNN(feature_dim=6, widths=(8, 8)))
    assert len(str(err.value).splitlines()) == 1


def test_bag_decision_is_fitted_held_out_and_travels_in_the_checkpoint(tmp_path: Path) -> None:
    """The two-stage head's default decision ('auto') is chosen among the candidates whose scores do
    not grow with bag length and calibrated on leave-one-bag-out cavities of the training bags at every epoch; it is part of
    the state dict, so the checkpoint predicts with it. An explicit rule is calibrated the same way."""
    data = feature_bags(num_bags=24, seed=4)
    for rule in ("auto", "noisy_or"):
        dm = BagArrayDataModule(**data, splits=["train"] * 18 + ["val"] * 6)
        model = GPMILModule(feature_dim=4, num_inducing=6, warmup_epochs=1, bag_rule=rule)
        assert not model.gp.calibrated
        _trainer(tmp_path / rule, 2).fit(model, dm)
        state = torch.load(tmp_path / rule / "last.ckpt", weights_only=True)["state_dict"]
        assert bool(state["gp.calibrator.fitted"]) and float(state["gp.calibrator.slope"]) > 0
        loaded = GPMILModule.load_from_checkpoint(str(tmp_path / rule / "last.ckpt"))
        assert loaded.gp.rule_name == model.gp.rule_name and (rule == "auto") == (loaded.gp.rule_name in ("max", "top_k_mean", "mean"))
        batch = _batch(data, range(18, 24))
        with torch.no_grad():
            assert [r["bag_prob"] for r in loaded.predict_records(batch)] == [r["bag_prob"] for r in model.predict_records(batch)]


def test_max_rule_reference_length_is_part_of_the_heads_state() -> None:
    """A decision on the max rule fitted on bags of up to n₀ instances predicts longer bags with the
    max at that resolution (MaxRule(reference_length=n₀)); n₀ must live in the head's state dict,
    or a reloaded head would predict thin-slice scans with the plain max. A state dict written
    before the buffer existed (a user's older checkpoint) loads as the plain max; other missing
    entries are still refused."""
    from milgp.likelihoods.instance_link import LogisticLink
    from milgp.prediction import BagCalibrator, BagDecision, BagPosterior, MaxRule

    g = torch.Generator().manual_seed(0)
    idx = torch.arange(4).repeat_interleave(torch.tensor([3, 5, 12, 20]))
    post = BagPosterior(torch.randn(len(idx), generator=g, dtype=torch.float64), torch.full((len(idx),), 0.3, dtype=torch.float64), Bags(idx, 4))
    head = GPMILModule(feature_dim=4, num_inducing=5).gp
    head.set_decision("max", BagDecision(MaxRule(reference_length=5), BagCalibrator(), 0.0, {}))
    expected, _ = MaxRule(reference_length=5)(post, LogisticLink())
    plain, _ = MaxRule()(post, LogisticLink())
    assert torch.equal(head.decide(post)[0], expected) and not torch.equal(expected, plain)
    state = head.state_dict()
    assert float(state["decision_reference_length"]) == 5.0
    fresh = GPMILModule(feature_dim=4, num_inducing=5).gp
    fresh.load_state_dict(state)
    assert torch.equal(fresh.decide(post)[0], expected) and fresh.decision_summary()["rule"] == "MaxRule(reference_length=5)"
    old = {k: v for k, v in state.items() if k != "decision_reference_length"}
    fresh.load_state_dict(old)
    assert torch.equal(fresh.decide(post)[0], plain)
    module = GPMILModule(feature_dim=4, num_inducing=5)  # a whole checkpoint's state goes through check_state
    module.gp.set_decision("max", BagDecision(MaxRule(reference_length=5), BagCalibrator(), 0.0, {}))
    module.load_state_dict({k: v for k, v in module.state_dict().items() if k != "gp.decision_reference_length"})
    assert torch.equal(module.gp.decide(post)[0], plain)
    with pytest.raises(InputError, match="'gp.calibrator.slope' is missing there"):
        module.load_state_dict({k: v for k, v in module.state_dict().items() if k != "gp.calibrator.slope"})


def test_end_to_end_decision_is_fitted_on_validation_with_a_cross_fitted_score(tmp_path: Path) -> None:
    """End to end the decision is fitted on the validation bags at each validation epoch, and the
    validation NLL that selects the checkpoint is cross-fitted: each fold of validation bags is
    scored by a decision fitted on the other fold (an in-sample NLL would flatter the decision)."""
    data = image_bags(num_bags=14, size=16, seed=6, max_slices=4)
    dm = BagArrayDataModule(**data, splits=["train"] * 6 + ["val"] * 8, batch_size=3)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=4, widths=(4, 4)), num_inducing=4, warmup_epochs=0)
    assert model.decision_bags == "val"
    trainer = _trainer(tmp_path, 1)
    trainer.fit(model, dm)
    assert model.gp.calibrated
    batch = _batch(data, sorted(range(6, 14), key=lambda i: f"bag_{i}"))  # the order validation sees (by bag id)
    with torch.no_grad():
        z = model.gp.standardize(model.features(batch.x))
        cross = model.gp.cross_fitted_nll(z, batch.bags, batch.bag_labels)
        assert cross == pytest.approx(float(trainer.callback_metrics["val/bag_nll"]), rel=1e-6)
        assert model.gp.cross_fitted_nll(z[batch.bag_index < 3], Bags(batch.bag_index[batch.bag_index < 3], 3), batch.bag_labels[:3]) is None


def test_threshold_half_means_something_for_g_vgpmil(tmp_path: Path) -> None:
    """G-VGPMIL's latent is not on the logistic scale: its raw noisy-OR sits near 1 for every bag,
    so deciding at ½ was chance. The calibrated default decision makes ½ a threshold that separates
    the held-out bags."""
    data = feature_bags(num_bags=40, seed=8)
    dm = BagArrayDataModule(**data, splits=["train"] * 24 + ["val"] * 6 + ["test"] * 10)
    likelihood = MILBernoulliLikelihood(psi=GammaPsi(alpha=1.0, beta=1.0))
    raw = GPMILModule(feature_dim=4, num_inducing=8, warmup_epochs=2, likelihood=likelihood, bag_rule="noisy_or")
    model = GPMILModule(feature_dim=4, num_inducing=8, warmup_epochs=2, likelihood=MILBernoulliLikelihood(psi=GammaPsi(alpha=1.0, beta=1.0)))
    for m in (raw, model):
        _trainer(tmp_path / str(id(m)), 4).fit(m, dm)
    raw.gp.calibrator.fitted.fill_(False)  # the paper's noisy-OR as it is, uncalibrated
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).test(raw, dm, verbose=False)
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).test(model, dm, verbose=False)
    assert raw.test_metrics["bag_accuracy"] <= 0.6
    assert model.test_metrics["bag_accuracy"] >= 0.8 and model.test_metrics["bag_nll"] < raw.test_metrics["bag_nll"]


def test_last_checkpoint_is_the_latest_epoch_when_the_best_is_earlier(tmp_path: Path) -> None:
    """``milgp-train``'s checkpoint callback keeps ``best.ckpt`` at the best epoch and ``last.ckpt``
    at the latest. With Lightning's own ``ModelCheckpoint`` (``save_top_k=1``, ``save_last=True``)
    ``last.ckpt`` is only rewritten when the best improves: here it held epoch 0, and
    ``--ckpt_path last`` would resume from there and train epochs 1–3 again."""
    _fit_worsening(tmp_path, epochs=4)
    assert torch.load(tmp_path / "best.ckpt", weights_only=False)["epoch"] == 0
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["epoch"] == 3


def test_resuming_a_moved_run_folder_keeps_its_best_checkpoint(tmp_path: Path) -> None:
    """A run folder copied (or moved) elsewhere and resumed there (``--ckpt_path last``) keeps
    ``best.ckpt`` at the best epoch, as it would in place. Lightning's ``ModelCheckpoint`` drops the
    best score when the checkpoint's stored folder is not the current one, so the resumed run's first
    epoch, however worse, replaced ``best.ckpt`` or was written beside it (here ``best-v1.ckpt``
    at epoch 2, and ``last-v1.ckpt``, leaving ``last.ckpt`` at the epoch resumed from)."""
    import shutil

    _fit_worsening(tmp_path / "a", epochs=2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _fit_worsening(tmp_path / "b", epochs=4, ckpt_path=tmp_path / "b" / "last.ckpt")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["best.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "b" / "best.ckpt", weights_only=False)["epoch"] == 0
    assert torch.load(tmp_path / "b" / "last.ckpt", weights_only=False)["epoch"] == 3


def _fit_worsening(folder: Path, epochs: int, ckpt_path: Path | None = None) -> None:
    """Fit a model whose validation loss grows every epoch (best at epoch 0) with ``milgp-train``'s
    checkpoint callback writing ``best.ckpt`` and ``last.ckpt`` into ``folder``."""
    from pytorch_lightning.demos.boring_classes import BoringModel

    from lightning_modules.callbacks import BestAndLastCheckpoint

    class Worsening(BoringModel):
        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.log("val_loss", float(self.current_epoch))  # best at epoch 0

    callback = BestAndLastCheckpoint(dirpath=str(folder), filename="best", monitor="val_loss", mode="min", save_top_k=1, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, limit_train_batches=2, limit_val_batches=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], default_root_dir=str(folder))
    trainer.fit(Worsening(), ckpt_path=None if ckpt_path is None else str(ckpt_path))
