"""The synthetic MIL set used by the convergence tests and benchmarks."""
import numpy as np

from milgp.data.synthetic_mil import synthetic_mil


def test_synthetic_mil_has_the_mil_structure_it_promises():
    """Exactly N instances in bags of 10–50 (the last may be shorter), witnesses only in positive
    bags and at least one in each, and the same set from the same seed; otherwise benchmarks that
    quote it would not be comparable, or would not be a MIL problem at all."""
    x, bag_index, bag_labels, inst = synthetic_mil(5000, seed=1)
    assert x.shape == (5000, 10) and bag_index.shape == inst.shape == (5000,)
    sizes = np.bincount(bag_index)
    assert (sizes[:-1] >= 10).all() and (sizes <= 50).all() and sizes.sum() == 5000
    witnesses = np.bincount(bag_index, weights=inst, minlength=len(bag_labels))
    assert (witnesses[bag_labels == 0] == 0).all() and (witnesses[bag_labels == 1] >= 1).all()
    again = synthetic_mil(5000, seed=1)
    assert np.array_equal(x, again[0]) and np.array_equal(bag_index, again[1])
