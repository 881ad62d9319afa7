"""Bag utilities: flat instances + bag_index (one ``(N, D)`` tensor and a bag id per instance)."""
import dataclasses
import warnings

import numpy as np
import pytest
import torch

from milgp.data.bags import (
    BagBatch,
    BagBatchSampler,
    Bags,
    bag_index_from_sizes,
    bag_sizes,
    collate_bags,
    flatten_bags,
    from_padded,
    identity_padded,
    segment_max,
    segment_sum,
    split_by_bag,
    to_padded,
)


def bags_list(seed=0, sizes=(3, 1, 5, 2)):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, 4)) for n in sizes]


def test_flatten_split_round_trip():
    """split_by_bag ∘ flatten_bags must be the identity (order within bags kept)."""
    bags = bags_list()
    x, bag_index = flatten_bags(bags)
    assert x.shape == (11, 4) and bag_index.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3]
    back = split_by_bag(x, bag_index)
    for a, b in zip(bags, back):
        np.testing.assert_array_equal(a, b.numpy())


def test_split_by_bag_with_interleaved_index():
    """split_by_bag must group by bag even when the instances of bags are interleaved."""
    values = torch.arange(6.0)
    bag_index = torch.tensor([1, 0, 1, 2, 0, 1])
    parts = split_by_bag(values, bag_index)
    assert [p.tolist() for p in parts] == [[1.0, 4.0], [0.0, 2.0, 5.0], [3.0]]


def test_padded_round_trip_and_mask():
    """to_padded/from_padded are inverses; mask marks real instances; padding is the fill."""
    bags = bags_list()
    x, bag_index = flatten_bags(bags)
    padded, mask = to_padded(x, Bags.from_index(bag_index), fill=-7.0)
    assert padded.shape == (4, 5, 4)
    assert mask.sum(1).tolist() == [3, 1, 5, 2]
    assert (padded[~mask] == -7.0).all()
    x2, bi2 = from_padded(padded, mask)
    torch.testing.assert_close(x2, x)
    assert bi2.tolist() == bag_index.tolist()


def test_padded_rows_of_a_larger_tensor_equal_padding_the_gathered_rows():
    """``to_padded(x, bags, rows=idx)`` pads ``x[idx]`` with one gather: it must equal padding the
    gathered rows, for rows in any order and a bag index that interleaves the bags."""
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([7, 2, 9, 0, 4, 5])
    bags = Bags.from_index(torch.tensor([1, 0, 1, 2, 0, 1]))
    padded, mask = to_padded(x, bags, fill=-1.0, rows=rows)
    expected, expected_mask = to_padded(x[rows], bags, fill=-1.0)
    assert torch.equal(padded, expected) and torch.equal(mask, expected_mask)


def test_segment_reductions_and_sizes():
    """segment_sum/segment_max/bag_sizes agree with per-bag Python reductions."""
    values = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0])
    bag_index = torch.tensor([0, 0, 1, 2, 2])
    assert segment_sum(values, bag_index, 3).tolist() == [-1.0, 3.0, 4.5]
    assert segment_max(values, bag_index, 3).tolist() == [1.0, 3.0, 4.0]
    assert bag_sizes(bag_index).tolist() == [2, 1, 2]
    assert bag_sizes(bag_index, 4).tolist() == [2, 1, 2, 0]


def test_select_bags_reindexes_and_keeps_fields():
    """select_bags returns the chosen bags in the requested order, re-indexed 0..k-1, with
    instance labels, weights and ids carried along."""
    bags = bags_list()
    x, bag_index = flatten_bags(bags)
    batch = BagBatch(
        x, bag_index, torch.tensor([1.0, 0.0, 1.0, 0.0]), instance_labels=torch.arange(11),
        instance_weights=torch.ones(11), bag_ids=["a", "b", "c", "d"],
    )
    sub = batch.select_bags([2, 0])
    assert sub.num_bags == 2 and sub.num_instances == 8
    assert sub.bag_index.tolist() == [0] * 5 + [1] * 3
    torch.testing.assert_close(sub.x[:5], torch.as_tensor(bags[2]))
    torch.testing.assert_close(sub.x[5:], torch.as_tensor(bags[0]))
    assert sub.bag_labels.tolist() == [1.0, 1.0]
    assert sub.instance_labels.tolist() == [4, 5, 6, 7, 8, 0, 1, 2]
    assert sub.bag_ids == ["c", "a"]
    moved = sub.to("cpu", torch.float32)
    assert moved.x.dtype == torch.float32 and moved.bag_index.dtype == torch.long


def test_collate_bags_tuples_and_dicts():
    """collate_bags accepts (x, instance_labels, bag_label, id) tuples and dicts."""
    bags = bags_list(sizes=(2, 3))
    batch = collate_bags([(bags[0], np.array([0, 1]), 1, "p"), (bags[1], np.array([0, 0, 0]), 0, "n")])
    assert batch.bag_index.tolist() == [0, 0, 1, 1, 1]
    assert batch.bag_labels.tolist() == [1.0, 0.0]
    assert batch.instance_labels.tolist() == [0, 1, 0, 0, 0]
    assert batch.bag_ids == ["p", "n"]
    batch2 = collate_bags([{"x": bags[0], "bag_label": 1}, {"x": bags[1], "bag_label": 0}])
    assert batch2.num_instances == 5 and batch2.instance_labels is None and batch2.bag_ids is None


@pytest.mark.parametrize("drop_last", [False, True])
def test_bag_batch_sampler_covers_each_bag_once_per_epoch(drop_last):
    """Every bag appears exactly once per epoch (unless dropped as the last partial batch),
    epochs are reshuffled, and len() matches the number of batches yielded."""
    sampler = BagBatchSampler(23, 5, shuffle=True, drop_last=drop_last, seed=1)
    epochs = [list(sampler) for _ in range(3)]
    for batches in epochs:
        assert len(batches) == len(sampler)
        flat = [b for batch in batches for b in batch]
        if drop_last:
            assert len(flat) == 20 and len(set(flat)) == 20
        else:
            assert sorted(flat) == list(range(23))
    assert epochs[0] != epochs[1]
    assert list(BagBatchSampler(7, 3, shuffle=False)) == [[0, 1, 2], [3, 4, 5], [6]]


def test_error_messages_name_the_bag():
    """Bad bags must raise ValueError naming the offending bag, not a torch.cat error."""
    with pytest.raises(ValueError, match="bag 1 is empty"):
        flatten_bags([np.ones((2, 3)), np.ones((0, 3))])
    with pytest.raises(ValueError, match="bag 2 has instances of shape"):
        flatten_bags([np.ones((2, 3)), np.ones((1, 3)), np.ones((2, 4))])
    with pytest.raises(ValueError, match="bag 0 is a scalar"):
        flatten_bags([np.float64(3.0)])
    with pytest.raises(ValueError, match="no bags"):
        flatten_bags([])
    with pytest.raises(ValueError, match="bag 1 is empty"):
        bag_index_from_sizes([2, 0, 1])
    with pytest.raises(ValueError, match="bags_per_batch"):
        BagBatchSampler(3, 0)


@pytest.mark.parametrize(
    "index, labels, message",
    [
        (torch.tensor([1, 1, 2, 3]), [1.0, 0.0, 1.0], r"^bag_index holds bag 3, but the 3 bag labels name bags 0\.\.2$"),
        (torch.tensor([0, 0, -1, 1]), [1.0, 0.0], r"^bag_index holds bag -1, but the 2 bag labels name bags 0\.\.1$"),
        (torch.tensor([0, 0, 1, 1]), [1.0, 0.0, 1.0, 0.0], r"^bag 2 has a label but no instances \(bag_index never takes that value; 2 such bag\(s\) in all\)$"),
        (torch.tensor([0.0, 0.0, 1.0, 1.0]), [1.0, 0.0], r"^bag_index must be a long \(int64\) tensor, got torch.float32; use bag_index.long\(\)$"),
        (torch.tensor([0, 0, 1, 1], dtype=torch.int32), [1.0, 0.0], r"^bag_index must be a long \(int64\) tensor, got torch.int32"),
        (torch.tensor([0, 0, 1, 1], dtype=torch.uint8), [1.0, 0.0], r"^bag_index must be a long \(int64\) tensor, got torch.uint8"),
        (torch.tensor([0, 0, 1]), [1.0, 0.0], r"^bag_index has shape \(3,\); it must be \(4,\), the bag of each instance of x$"),
        (torch.tensor([0, 0, 1, 1]), [[1.0, 0.0]], r"^a batch needs bag_labels \(B,\)"),
    ],
)
def test_check_refuses_a_malformed_batch_naming_the_field(index, labels, message):
    """If this failed, a batch built by hand with 1-based bag ids would fail deep inside a fit with
    "index 3 is out of bounds", and a label of a bag without instances would be fitted silently as
    a bag with no evidence."""
    batch = BagBatch(torch.randn(4, 2), index, torch.tensor(labels))
    with pytest.raises(ValueError, match=message):
        batch.check()
    good = BagBatch(torch.randn(4, 2), torch.tensor([1, 0, 1, 0]), torch.tensor([1.0, 0.0]))
    assert good.check() is good


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_of_a_cuda_batch_synchronises_with_the_device_once():
    """If this failed, ``check`` would read the device more than once (the fits call it on every
    GPU fit; each read waits for all queued kernels), against its docstring."""
    batch = BagBatch(torch.randn(6, 2, device="cuda"), torch.tensor([0, 0, 1, 1, 2, 2], device="cuda"), torch.ones(3, device="cuda"))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            batch.check()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("called a synchronizing CUDA operation" in str(w.message) for w in caught) == 1  # not the mode's own notice


def test_random_bags_within_a_budget():
    """Whole bags in random order up to the instance budget, at least one bag even when the first
    drawn is over budget, the same bags from the same generator state; otherwise hyperparameter
    steps would see split bags, nothing, or a different subset on a rerun."""
    from milgp.data.bags import random_bags_within

    sizes = torch.tensor([5, 1, 7, 2, 4, 3])
    for seed in range(10):
        keep = random_bags_within(sizes, 9, torch.Generator().manual_seed(seed))
        assert len(set(keep.tolist())) == len(keep) >= 1 and int(sizes[keep].sum()) <= 9
        order = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
        assert keep.tolist() == order[: len(keep)].tolist()  # a prefix of the random order
        again = random_bags_within(sizes, 9, torch.Generator().manual_seed(seed))
        assert torch.equal(keep, again)
    assert random_bags_within(torch.tensor([50, 60]), 9, torch.Generator().manual_seed(0)).numel() == 1


def test_identity_padded_keeps_real_entries_and_makes_padding_the_identity():
    """Per-bag blocks padded to the longest bag must keep every real entry (symmetrised), and their
    padded rows and columns must be the identity: otherwise a padded block is singular or couples
    a bag's instances to padding, and its Cholesky factor is wrong."""
    g = torch.Generator().manual_seed(0)
    bag_index = torch.tensor([0, 1, 1, 0, 1, 2])
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)
    x_pad, mask = to_padded(x, Bags(bag_index, 3))
    cov = x_pad @ x_pad.mT + 5.0  # padded entries hold garbage (5.0)
    cov[:, 0, 1] += 1e-3  # a slightly asymmetric real pair
    out = identity_padded(cov, mask)
    for b, n in enumerate([2, 3, 1]):
        real = cov[b, :n, :n]
        torch.testing.assert_close(out[b, :n, :n], 0.5 * (real + real.mT))
        torch.testing.assert_close(out[b, n:, n:], torch.eye(3 - n, dtype=torch.float64))
        assert (out[b, :n, n:] == 0).all() and (out[b, n:, :n] == 0).all()
    torch.linalg.cholesky(out + 1e-9 * torch.eye(3, dtype=torch.float64))  # positive definite


def test_bags_counts_once_and_keeps_what_it_derives():
    """``Bags`` is the bag structure as one immutable object: sizes and the within-bag layout are
    computed on first use and kept (the exact q(y) sweep asks for the layout every sweep), a
    batch builds its ``Bags`` once, and a batch made by ``select_bags`` or ``to`` gets its own. If
    this fails, a fit recomputes the layout every sweep, or a sub-batch reuses its parent's
    structure (wrong bags swept together)."""
    index = torch.tensor([0, 1, 1, 2, 2, 2, 1])
    bags = Bags.from_index(index)
    assert bags.num_bags == 3 and bags.num_instances == 7
    assert bags.sizes.tolist() == [1, 3, 3] and bags.sizes is bags.sizes
    assert bags.layout is bags.layout
    assert bags.layout.counts == [3, 2, 2] and bags.layout.bag_order.tolist() == [1, 2, 0]
    assert Bags.from_index(index, 5).sizes.tolist() == [1, 3, 3, 0, 0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        bags.num_bags = 4
    batch = BagBatch(torch.zeros(7, 2), index, torch.zeros(3))
    assert batch.bags is batch.bags and batch.bags.num_bags == 3 and batch.bags.index is index
    sub = batch.select_bags(torch.tensor([2]))
    assert sub.bags is not batch.bags and sub.bags.sizes.tolist() == [3]
    assert batch.to(dtype=torch.float64).bags is not batch.bags


def test_bags_keep_their_padding_and_groups_per_bound():
    """The padding positions and the size-sorted groups of whole bags are computed once per
    ``Bags`` (and per bound, for groups), and the groups partition the bags within the bounds. If
    this fails, every padded pass or joint bag rule recomputes them, a cached grouping is served for
    another bound, or a bag is split across groups (its block would be wrong)."""
    index = torch.tensor([0, 1, 1, 2, 2, 2, 1, 3, 3, 3, 3, 3])
    bags = Bags.from_index(index)
    assert bags.padding is bags.padding and bags.padding.n_max == 5
    x = torch.arange(12.0)
    padded, mask = to_padded(x, bags, fill=-1.0)
    assert padded[1].tolist() == [1.0, 2.0, 6.0, -1.0, -1.0] and mask.sum(1).tolist() == [1, 3, 3, 5]
    small = bags.groups(chunk_instances=4)
    assert bags.groups(chunk_instances=4) is small and bags.groups(chunk_instances=100) is not small
    assert sorted(int(b) for g in small for b in g.bags) == [0, 1, 2, 3]
    for g in small:
        assert torch.equal(index[g.inst], g.bags[g.local])  # whole bags, their own instances
        assert g.inst.numel() <= 4 or g.num_bags == 1
    # B_g · n_max² ≤ 20: bags of sizes 1 and 3 share a group (2·9), a third bag of 3 would not (3·9)
    assert [g.bags.tolist() for g in bags.groups(chunk_instances=100, block_budget=20)] == [[0, 1], [2], [3]]


def test_groups_never_pad_short_bags_to_a_long_one():
    """With a block budget (padded per-bag blocks), a bag far longer than the others of its group
    starts a new one: four bags of one and a bag of 10 in one group would pad to 5 · 10² = 500 block
    entries for the 104 they hold. If this fails, padded work (cavities, joint bag rules, aggregate
    fits) grows with the spread of the bag sizes, not with the bags."""
    bags = Bags.from_index(torch.tensor([0, 1, 2, 3] + [4] * 10))
    assert [g.bags.tolist() for g in bags.groups(chunk_instances=100, block_budget=10**6)] == [[0, 1, 2, 3], [4]]
    assert [g.bags.tolist() for g in bags.groups(chunk_instances=100)] == [[0, 1, 2, 3, 4]]  # no blocks: one group
    sizes = Bags.from_index(torch.repeat_interleave(torch.arange(30), torch.arange(1, 31))).groups(10**4, 10**6)
    for g in sizes:
        n = g.local.bincount()
        assert g.num_bags * int(n.max()) ** 2 <= 2 * int((n * n).sum())


def _bag_items(n: int) -> list[tuple]:
    g = torch.Generator().manual_seed(n)
    return [(torch.rand(3 + b, 2, 5, generator=g), torch.ones(3 + b), float(b % 2), f"bag{b}") for b in range(n)]


class _Bags(torch.utils.data.Dataset):
    def __init__(self, items: list[tuple]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple:
        return self.items[i]


def _collate_reporting_shared(items: list[tuple]) -> tuple:
    batch = collate_bags(items)
    return batch, batch.x.is_shared()  # read in the worker, before the batch is sent


def test_collate_in_a_loader_worker_writes_the_batch_into_shared_memory_once() -> None:
    """In a DataLoader worker ``collate_bags`` concatenates straight into shared memory (a batch
    in ordinary memory is copied once more to reach the main process: for CT batches of hundreds
    of slices that copy cost as much as the collate). The batch must equal the in-process one."""
    items = _bag_items(4)
    expected = collate_bags(items)
    assert not expected.x.is_shared()
    loader = torch.utils.data.DataLoader(_Bags(items), batch_size=4, collate_fn=_collate_reporting_shared, num_workers=1)
    ((batch, shared_in_worker),) = list(loader)
    assert shared_in_worker
    torch.testing.assert_close(batch.x, expected.x)
    torch.testing.assert_close(batch.bag_index, expected.bag_index)
    assert batch.bag_ids == expected.bag_ids


def test_check_refuses_a_nan_or_inf_feature_naming_the_instance():
    """If this failed, fit_closed_form on a batch with a NaN would end ten frames deep in a Cholesky
    error ("q(v) precision contains NaN or inf entries") naming no instance."""
    x = torch.randn(5, 2)
    x[3, 1] = float("inf")
    batch = BagBatch(x, torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"^x has NaN or inf features in instance 3 \(bag 1; 1 such instance\(s\) in all\)$"):
        batch.check()
