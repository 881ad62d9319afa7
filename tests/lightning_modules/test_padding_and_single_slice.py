"""Padding never changes a bag's prediction, and bags of one slice work (attention and GP)."""
from __future__ import annotations

import numpy as np
import torch

from lightning_modules import AttentionMILModule, GPMILModule, SmallCNN
from milgp.data.bags import collate_bags
from lm_helpers import image_bags


def _samples(data, idx):
    return [(torch.as_tensor(data["bags"][i]), torch.as_tensor(data["instance_labels"][i]), data["bag_labels"][i], f"b{i}") for i in idx]


def _models():
    torch.manual_seed(0)
    att = AttentionMILModule(SmallCNN(feature_dim=6, widths=(4, 8)), attention_dim=5).eval()
    torch.manual_seed(0)
    gp = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=6, widths=(4, 8)), num_inducing=6).eval()
    data = image_bags(num_bags=6, size=16, seed=1, max_slices=6)
    feats = torch.cat([gp.features(torch.as_tensor(b)) for b in data["bags"]]).detach()
    labels = torch.cat([torch.full((len(b),), y) for b, y in zip(data["bags"], data["bag_labels"])])
    gp.gp.initialize(feats, labels)
    return att, gp


def test_padding_never_changes_a_bags_prediction() -> None:
    """A short bag predicted alone and next to a much longer bag (so it is padded in the attention
    softmax) gets the same bag probability, the same attention weights and, for the GP, the same
    slice probabilities and stds.

    If this fails, padded slices leak into the softmax or reach the CNN/normalisation."""
    data = image_bags(num_bags=6, size=16, seed=1, max_slices=6)
    data["bags"][0] = data["bags"][0][:2]
    data["instance_labels"][0] = data["instance_labels"][0][:2]
    data["bags"][1] = np.concatenate([data["bags"][1]] * 4)[:9]
    data["instance_labels"][1] = np.concatenate([data["instance_labels"][1]] * 4)[:9]
    att, gp = _models()
    alone = collate_bags(_samples(data, [0]))
    mixed = collate_bags(_samples(data, [1, 0, 2]))
    with torch.no_grad():
        for model in (att, gp):
            r_alone = model.predict_records(alone)[0]
            r_mixed = [r for r in model.predict_records(mixed) if r["bag_id"] == "b0"][0]
            assert abs(r_alone["bag_prob"] - r_mixed["bag_prob"]) < 1e-6
            np.testing.assert_allclose(r_alone["slice_scores"], r_mixed["slice_scores"], atol=1e-6)
            np.testing.assert_allclose(r_alone["slice_probs"], r_mixed["slice_probs"], atol=1e-6)
        out = att(mixed.x, mixed.bags)
        sums = torch.zeros(3).index_add_(0, mixed.bag_index, out["attention"])
        torch.testing.assert_close(sums, torch.ones(3))


def test_bags_of_one_slice_train_and_predict() -> None:
    """Bags with a single slice go through a training step and prediction of both modules.

    If this fails, a one-instance bag breaks the softmax (NaN), the noisy-OR locals or the
    natural step."""
    data = image_bags(num_bags=4, size=16, seed=2, max_slices=3)
    for i in range(4):
        data["bags"][i] = data["bags"][i][:1]
        data["instance_labels"][i] = data["instance_labels"][i][:1]
    batch = collate_bags(_samples(data, range(4)))
    att, gp = _models()
    att.train()
    loss = att.training_step(batch, 0)
    assert torch.isfinite(loss)
    loss.backward()
    rec = att.predict_records(batch)
    assert all(r["slice_scores"] == [1.0] for r in rec)
    gp.num_train_bags = 4
    with torch.no_grad():
        z = gp.gp.standardize(gp.features(batch.x))
        steps = gp.gp.fit_steps(z, batch.bags, batch.bag_labels)
        steps.sweep()
    assert torch.isfinite(steps.locals).all()
    rec = gp.predict_records(batch)
    assert all(np.isfinite(r["bag_prob"]) and len(r["slice_probs"]) == 1 for r in rec)
    # a bag of one: the bag probability is its slice's probability (every bag rule of one instance, uncalibrated)
    assert all(abs(r["bag_prob"] - r["slice_probs"][0]) < 1e-6 for r in rec)
