"""GPHead's training step: its cost on a GPU is one launch per operation."""
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
