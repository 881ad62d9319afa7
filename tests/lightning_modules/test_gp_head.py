"""GPHead: its training step's cost on a GPU (one launch per operation), and features constant in training."""
from __future__ import annotations

import torch

from lightning_modules import GPMILModule, SmallCNN
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
