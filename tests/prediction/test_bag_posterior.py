"""BagPosterior: the instance posterior the bag rules read."""
import pytest
import torch

from milgp.data.bags import Bags
from milgp.prediction import BagPosterior


def test_a_bag_without_instances_is_refused_by_name():
    """Bag 1 of 3 has no instances (bag_index skips it): one line naming bag 1. If this fails, the
    rules gave it a value of their own — max −inf, noisy-OR −0.0, top-k and mean 0 — and the −inf
    reached the calibration and the metrics."""
    mean, var = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^bag 1 has no instances \(1 such bag\(s\)\): number the bags of a prediction 0\.\.B-1"):
        BagPosterior(mean, var, Bags(torch.tensor([0, 2]), 3))
    mask = torch.tensor([[True, True], [False, False]])
    with pytest.raises(ValueError, match=r"^bag 1 has no instances"):
        BagPosterior.from_blocks(torch.zeros(2, 2, dtype=torch.float64), torch.eye(2, dtype=torch.float64).expand(2, 2, 2), mask)
