"""The per-bag locals store: kept and returned by bag id in any batch order, and a state_dict that
round-trips whatever the number of bags."""
import io

import numpy as np
import pytest
import torch

from milgp.data.bags import Bags
from milgp.variational.bag_locals import BagLocals


def _batch(ids_sizes: list[tuple[str, int]], interleave: bool) -> tuple[list[str], Bags, torch.Tensor]:
    """Bags with the given ids and sizes; locals ``100·k + position`` for id ``"b<k>"`` (99 for
    other ids) so every value names its bag and place. ``interleave``: instances of different bags alternate in the flat order."""
    index = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(ids_sizes)])
    values = torch.cat([100.0 * (int(i[1:]) if i[1:].isdigit() else 99) + torch.arange(n, dtype=torch.float64) for i, n in ids_sizes])
    if interleave:
        order = torch.argsort(torch.cat([torch.arange(n) for _, n in ids_sizes]), stable=True)
        index, values = index[order], values[order]
    return [i for i, _ in ids_sizes], Bags(index, len(ids_sizes)), values


def test_a_bag_gets_back_its_own_locals_in_another_batch_and_order():
    """If this failed, a bag drawn again in a later minibatch would continue from another bag's
    (or a shuffled copy of its own) q(y)."""
    store = BagLocals()
    ids, bags, values = _batch([("b1", 3), ("b2", 2), ("b3", 4)], interleave=True)
    store.store(ids, bags, values)
    assert len(store) == 3 and store.ids() == ["b1", "b2", "b3"]
    ids2, bags2, expected = _batch([("b3", 4), ("b1", 3)], interleave=False)
    torch.testing.assert_close(store.gather(ids2, bags2), expected, rtol=0, atol=0)
    ids3, bags3, expected3 = _batch([("b2", 2), ("b3", 4)], interleave=True)
    torch.testing.assert_close(store.gather(ids3, bags3), expected3, rtol=0, atol=0)
    torch.testing.assert_close(store.cat(["b2", "b1"]), torch.tensor([200.0, 201.0, 100.0, 101.0, 102.0], dtype=torch.float64))


def test_unknown_or_resized_bags_and_non_instance_locals_are_not_served():
    """A new bag, a bag whose size changed (other data under the same id) or a batch without ids
    must be initialised by the fit (``None``), and locals that are not one value per instance
    (an aggregate likelihood's ``None``) are not stored."""
    store = BagLocals()
    ids, bags, values = _batch([("b1", 3), ("b2", 2)], interleave=False)
    store.store(ids, bags, values)
    assert store.gather(*_batch([("b1", 3), ("b4", 2)], interleave=False)[:2]) is None
    assert store.gather(*_batch([("b1", 4)], interleave=False)[:2]) is None
    assert store.gather(None, bags) is None
    store.store(["b5"], Bags(torch.zeros(3, dtype=torch.long), 1), None)
    assert "b5" not in store and len(store) == 2


def test_integer_ids_in_a_tensor_an_array_or_a_list_name_the_same_bags_as_their_strings():
    """If this failed, a training loop that numbers its bags (a tensor ``(B,)`` of ids, as the
    README's loop does) would get NumPy's or torch's "truth value is ambiguous" instead of its
    bags' locals, or store them under keys its next batch never finds."""
    store = BagLocals()
    _, bags, values = _batch([("b1", 3), ("b2", 2)], interleave=True)
    store.store(torch.tensor([1, 2]), bags, values)
    assert store.ids() == ["1", "2"]
    torch.testing.assert_close(store.gather(np.array([1, 2]), bags), values, rtol=0, atol=0)
    torch.testing.assert_close(store.gather(["1", 2], bags), values, rtol=0, atol=0)
    torch.testing.assert_close(store.cat(torch.tensor([2])), values[bags.index == 1], rtol=0, atol=0)


def test_a_count_of_ids_other_than_the_bags_is_refused_in_one_line():
    """If this failed, three ids for two bags (or one) would be zipped away silently: locals stored
    under the wrong bags, or a batch that never gets its own back."""
    store = BagLocals()
    ids, bags, values = _batch([("b1", 3), ("b2", 2)], interleave=False)
    for wrong in (ids[:1], ids + ["b3"]):
        for call in (lambda: store.store(wrong, bags, values), lambda: store.gather(wrong, bags)):
            with pytest.raises(ValueError, match=rf"^bag_ids: {len(wrong)} ids for a batch of 2 bags") as err:
                call()
            assert "\n" not in str(err.value)


def test_gathered_pairs_from_every_process_are_all_kept():
    """Under DDP each rank must hold every rank's bags (a bag can land on another rank next epoch)."""
    store = BagLocals()
    ids, bags, values = _batch([("b1", 2)], interleave=False)
    other = [("b7", torch.tensor([7.0, 7.5], dtype=torch.float64))]
    store.store(ids, bags, values, gather=lambda mine: [mine, other])
    assert store.ids() == ["b1", "b7"]
    torch.testing.assert_close(store["b7"], other[0][1])


def test_state_dict_round_trips_into_an_empty_store_through_a_weights_only_file():
    """The locals must travel in a checkpoint as plain tensors (``torch.load(weights_only=True)``)
    and load into a store that holds no or other bags."""
    store = BagLocals()
    ids, bags, values = _batch([("b2", 2), ("b10", 3), ("naïve id", 1)], interleave=True)
    store.store(ids, bags, values)
    state = store.state_dict()
    assert set(state) == {"ids", "sizes", "values"} and all(isinstance(v, torch.Tensor) for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = BagLocals({"old": torch.zeros(5)})
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.ids() == sorted(ids)
    for bag_id in ids:
        torch.testing.assert_close(fresh[bag_id], store[bag_id], rtol=0, atol=0)
    empty = BagLocals()
    empty.load_state_dict(BagLocals().state_dict())
    assert len(empty) == 0


def test_an_inconsistent_or_missing_state_is_refused():
    """Sizes that do not add up to the stored values must not load silently as other bags' locals."""
    store = BagLocals()
    ids, bags, values = _batch([("b1", 3), ("b2", 2)], interleave=False)
    store.store(ids, bags, values)
    state = store.state_dict()
    state["sizes"] = torch.tensor([3, 3])
    with pytest.raises(RuntimeError, match="do not agree"):
        BagLocals().load_state_dict(state)
    with pytest.raises(RuntimeError, match="Missing key"):
        BagLocals().load_state_dict({"ids": state["ids"]})
