"""GPHead: its training step's cost on a GPU (one launch per operation), and features constant in training."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_modules import GPMILModule, SmallCNN
from lightning_modules.cli import main
from lightning_modules.features import FeatureTable, save_features
from milgp.prediction.bag_posterior import MAX_JOINT_INSTANCES
from lm_helpers import feature_bags, trainer_cfg, write_config
from milgp.data.bags import Bags, bag_index_from_sizes


def _ops_per_step(slices: int) -> int:
    torch.manual_seed(0)
    model = GPMILModule(mode="end_to_end", extractor=SmallCNN(feature_dim=8, widths=(4, 4)), num_inducing=16)
    model.gp.initialize(torch.randn(32, 8), torch.arange(32) % 2)
    bags, labels = Bags(bag_index_from_sizes([slices] * 3), 3), torch.tensor([0.0, 1.0, 1.0])
    h = torch.randn(3 * slices, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        z = model.gp.standardize(h)
        steps = model.gp.fit_steps(z, bags, labels)
        steps.minibatch_step(None, 0.5, 10.0)
        (-steps.hyper_objective(z)).backward()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def test_the_default_heads_step_launches_as_many_operations_for_long_bags_as_for_short() -> None:
    """The default head's locals are the parallel largest-other-π update, so a training step
    dispatches the same operations for bags of 8 and of 57 slices. The exact leave-one-out rule
    updates one slice position after another: its step grew with the bag length (on a GPU, where
    every operation is a kernel launch, from 1,393 to 2,450 launches at 24 and 57 slices)."""
    _ops_per_step(4)  # made once per device and kept (the quadrature's nodes)
    assert _ops_per_step(8) == _ops_per_step(57)


def test_a_feature_constant_at_initialize_is_ignored_in_prediction_and_end_to_end() -> None:
    """A feature with no spread in the head's training features (a CNN unit never active on the
    training slices) must standardise to 0 whatever value it takes later, and keep doing so through
    end-to-end updates of the statistics (even at momentum 1, where 0 · inf would give NaN). Before,
    its scale was 1 and a value it took only at prediction entered the kernel in raw units."""
    from lightning_modules.gp_head import GPHead

    head = GPHead(feature_dim=3, num_inducing=8)
    h = torch.randn(40, 3, dtype=torch.float64)
    h[:, 1] = 0.0
    head.initialize(h, torch.arange(40) % 2)
    probe = torch.tensor([[0.5, 0.0, -0.2], [0.5, 30.0, -0.2]], dtype=torch.float64)
    z = head.standardize(probe)
    assert torch.equal(z[0], z[1]) and z[1, 1] == 0
    for momentum in (0.1, 1.0):
        head.update_standardization(torch.randn(20, 3, dtype=torch.float64), momentum, lambda t: t)
        z = head.standardize(probe)
        assert torch.isfinite(z).all() and torch.equal(z[0], z[1])


def test_a_bag_too_long_for_a_joint_bag_rule_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bag longer than the joint rule's limit (MAX_JOINT_INSTANCES) stops `fit` (at the data
    module's setup, before any training) and `predict` with exit status 2 and one line naming the
    bag, the limit and the way out. If this fails, the whole run aborts with a ValueError
    traceback from BagPosterior.joint_blocks naming the bag by its position in a batch."""
    bags = feature_bags(num_bags=12)
    ids, splits = [f"b{i:02d}" for i in range(12)], ["train"] * 6 + ["test"] * 2 + ["val"] * 4
    long = np.random.default_rng(0).standard_normal((MAX_JOINT_INSTANCES + 1, 4)).astype(np.float32)
    for name, x in (("short.npz", bags["bags"]), ("long.npz", [*bags["bags"][:-1], long])):
        inst = [np.zeros(len(b), np.float32) for b in x]
        save_features(tmp_path / name, FeatureTable.from_bags(x, ids, bags["bag_labels"], inst, splits=splits))
    model = {"class_path": "lightning_modules.GPMILModule",
             "init_args": {"feature_dim": 4, "num_inducing": 4, "warmup_epochs": 0, "bag_rule": "joint_max"}}

    def config(name: str, data: str) -> str:
        return write_config(tmp_path / f"{name}.yaml", {"trainer": trainer_cfg(tmp_path, name), "model": model, "data": {
            "class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / data)}}})

    expected = f"bag 'b11' has {MAX_JOINT_INSTANCES + 1} instances, more than the {MAX_JOINT_INSTANCES} that bag_rule 'joint_max' reads jointly"
    assert main(["fit", "--config", config("long", "long.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "marginal bag_rule" in err, err
    assert not (tmp_path / "long" / "checkpoints").exists()
    assert main(["fit", "--config", config("short", "short.npz")]) == 0
    capsys.readouterr()
    predict = config("short", "long.npz")
    assert main(["predict", "--config", predict, "--ckpt_path", "last", "--data.init_args.predict_split", "val"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
