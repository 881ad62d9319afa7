"""Bags in memory: flat instances plus a bag index.

A minibatch of bags is stored like a graph batch:

* ``x``: ``(N, ...)`` all instances of all bags, concatenated;
* ``bag_index``: ``LongTensor (N,)`` with values ``0..B-1`` saying which bag each instance is in;
* ``bag_labels``: ``(B,)``.

:class:`Bags` is the index and the number of bags as one object, built once per batch
(:attr:`BagBatch.bags`) and passed to the likelihoods.

Per-bag reductions use ``index_add_`` / ``scatter_reduce`` (:func:`segment_sum`,
:func:`segment_max`), never a Python loop over bags. A dense ``(B, N_max, ...)`` tensor with a
mask exists only where an operator needs one (:func:`to_padded`, e.g. attention softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BagBatch",
    "BagLayout",
    "Bags",
    "BagBatchSampler",
    "BagGroup",
    "bag_index_from_sizes",
    "bag_sizes",
    "check_bag_index_dtype",
    "collate_bags",
    "flatten_bags",
    "from_padded",
    "identity_padded",
    "Padding",
    "make_bag_groups",
    "random_bags_within",
    "segment_logsumexp",
    "segment_max",
    "segment_sum",
    "split_by_bag",
    "to_padded",
    "weights_or_ones",
    "without_negative_strides",
]


def check_bag_index_dtype(bag_index: Tensor) -> None:
    """One-line ``ValueError`` unless ``bag_index`` is a long tensor (what indexing and scatter need)."""
    if bag_index.dtype != torch.long:
        raise ValueError(f"bag_index must be a long (int64) tensor, got {bag_index.dtype}; use bag_index.long()")


def bag_index_from_sizes(sizes: Sequence[int] | Tensor, device: torch.device | None = None) -> Tensor:
    """``bag_index`` ``(N,)`` for bags of the given sizes, e.g. ``[2, 3] -> [0, 0, 1, 1, 1]``."""
    sizes_t = torch.as_tensor(sizes, dtype=torch.long, device=device)
    if sizes_t.ndim != 1:
        raise ValueError(f"bag sizes must be one-dimensional, got shape {tuple(sizes_t.shape)}")
    if (sizes_t < 1).any():
        bad = int(torch.nonzero(sizes_t < 1)[0])
        raise ValueError(f"bag {bad} is empty: every bag needs at least one instance")
    return torch.repeat_interleave(torch.arange(len(sizes_t), device=sizes_t.device), sizes_t)


def bag_sizes(bag_index: Tensor, num_bags: int | None = None) -> Tensor:
    """Number of instances per bag, ``(B,)``."""
    num_bags = int(bag_index.max()) + 1 if num_bags is None else num_bags
    # a scatter, not torch.bincount: on a GPU bincount reads the largest index back to the host
    return torch.zeros(num_bags, dtype=torch.long, device=bag_index.device).index_add_(0, bag_index, torch.ones_like(bag_index))


def random_bags_within(sizes: Tensor, max_instances: int, generator: torch.Generator) -> Tensor:
    """Ids of whole bags in random order (``torch.randperm`` from ``generator``), as many as fit in
    ``max_instances`` instances (at least one bag); ``sizes`` ``(B,)`` from :func:`bag_sizes`."""
    order = torch.randperm(len(sizes), generator=generator).to(sizes.device)
    keep = order[torch.cumsum(sizes[order], 0) <= max_instances]
    return order[:1] if keep.numel() == 0 else keep


@dataclass
class BagLayout:
    """Instances ordered position-major for a coordinate-ascent sweep over positions in bags.

    Bags are ranked by decreasing size (``bag_order``), so the bags that have a ``k``-th instance
    are always the first ``counts[k]`` of that ranking; ``flat`` lists instance indices position by
    position, within a position in bag-rank order. A sweep then works on contiguous slices (no
    per-position gather/scatter). An instance's position is its order of appearance in its bag.
    """

    flat: Tensor
    bag_order: Tensor
    counts: list[int]


@dataclass(frozen=True)
class Padding:
    """Where the instances of :class:`Bags` go in a dense ``(B, n_max)`` layout: ``order`` ``(N,)``
    the instances sorted (stably) by bag, ``bag`` and ``position`` ``(N,)`` the bag and slot of
    each of them, ``starts`` ``(B,)`` where each bag begins in ``order``, and ``n_max`` the largest
    bag size."""

    order: Tensor
    bag: Tensor
    position: Tensor
    starts: Tensor
    n_max: int


@dataclass(frozen=True, eq=False)
class Bags:
    """Which bag each instance of a flat batch belongs to: ``index`` ``(N,)`` long with values
    ``0..B-1`` and ``num_bags`` ``B``.

    Immutable. What is derived from it — :attr:`sizes` ``(B,)`` and the position-major
    :attr:`layout` of the exact ``q(y)`` sweep — is computed the first time it is asked for and
    kept on the object, so a fit that passes the same ``Bags`` to every sweep computes it once (and
    never needs ``index.max()``, a device synchronisation, to count the bags).
    """

    index: Tensor
    num_bags: int
    _groups: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_index(cls, index: Tensor, num_bags: int | None = None) -> "Bags":
        """``Bags`` of ``index``; ``num_bags`` defaults to ``index.max() + 1``."""
        return cls(index, int(index.max()) + 1 if num_bags is None else int(num_bags))

    @property
    def num_instances(self) -> int:
        return int(self.index.shape[0])

    @cached_property
    def sizes(self) -> Tensor:
        """Instances per bag ``(B,)``."""
        return bag_sizes(self.index, self.num_bags)

    @cached_property
    def layout(self) -> BagLayout:
        """The :class:`BagLayout` of the bags."""
        pos = torch.empty_like(self.index)
        pos[self.padding.order] = self.padding.position
        bag_order = torch.argsort(-self.sizes, stable=True)
        rank = torch.empty_like(bag_order)
        rank[bag_order] = torch.arange(self.num_bags, device=self.index.device)
        flat = torch.argsort(pos * max(1, self.num_bags) + rank[self.index])
        counts = torch.bincount(pos).tolist() if len(pos) else []
        return BagLayout(flat=flat, bag_order=bag_order, counts=counts)

    @cached_property
    def padding(self) -> Padding:
        """The :class:`Padding` of the bags (:func:`to_padded`)."""
        sizes = self.sizes
        order = torch.argsort(self.index, stable=True)
        bag = self.index[order]
        starts = torch.cumsum(sizes, 0) - sizes
        position = torch.arange(len(order), device=self.index.device) - starts[bag]
        return Padding(order, bag, position, starts, int(sizes.max()) if sizes.numel() else 0)

    def groups(self, chunk_instances: int = 32768, block_budget: int | None = None) -> list["BagGroup"]:
        """All bags packed into groups of whole bags (:func:`make_bag_groups`); kept per bound."""
        key = (int(chunk_instances), block_budget)
        if key not in self._groups:
            self._groups[key] = make_bag_groups(self, chunk_instances, block_budget)
        return self._groups[key]


def weights_or_ones(weights: Tensor | None, like: Tensor) -> Tensor:
    """Instance weights (populations) ``weights`` in the dtype and device of ``like``; ones shaped
    like ``like`` when ``None`` (the default of every aggregate likelihood and fit)."""
    return torch.ones_like(like) if weights is None else weights.to(like)


def segment_sum(values: Tensor, bag_index: Tensor, num_bags: int) -> Tensor:
    """Sum of ``values`` ``(N, ...)`` within each bag -> ``(B, ...)``."""
    out = values.new_zeros((num_bags,) + tuple(values.shape[1:]))
    return out.index_add_(0, bag_index, values)


def segment_max(values: Tensor, bag_index: Tensor, num_bags: int) -> Tensor:
    """Maximum of ``values`` ``(N,)`` within each bag -> ``(B,)``."""
    out = values.new_full((num_bags,), float("-inf"))
    return out.scatter_reduce(0, bag_index, values, reduce="amax", include_self=True)


def segment_logsumexp(values: Tensor, bag_index: Tensor, num_bags: int) -> Tensor:
    """``log Σ_{i∈a} exp(values_i)`` per bag ``(B,)``, stable (max-shifted, by 0 where a bag's largest
    value is infinite), differentiable."""
    top = segment_max(values.detach(), bag_index, num_bags)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return top + torch.log(segment_sum(torch.exp(values - top[bag_index]), bag_index, num_bags))


def without_negative_strides(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it when a stride is negative (a reversed view such as ``x[::-1]`` or
    ``np.flip``), which ``torch.as_tensor`` refuses."""
    return a.copy() if any(s < 0 for s in a.strides) else a


def flatten_bags(bags: Sequence[Any]) -> tuple[Tensor, Tensor]:
    """Concatenate a sequence of bags ``(n_b, ...)`` into ``(x (N, ...), bag_index (N,))``.

    Raises a ``ValueError`` naming the bag when one is empty, not array-like, or has a trailing
    shape different from the first bag.
    """
    if len(bags) == 0:
        raise ValueError("no bags given: need at least one bag")
    tensors = []
    for b, bag in enumerate(bags):
        try:
            t = torch.as_tensor(bag if isinstance(bag, Tensor) else without_negative_strides(np.asarray(bag)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"bag {b} is not an array of instances: {err}") from err
        if t.ndim == 0:
            raise ValueError(f"bag {b} is a scalar, expected an array of shape (n_b, ...)")
        if t.shape[0] == 0:
            raise ValueError(f"bag {b} is empty: every bag needs at least one instance")
        if tensors and t.shape[1:] != tensors[0].shape[1:]:
            raise ValueError(
                f"bag {b} has instances of shape {tuple(t.shape[1:])}, "
                f"but bag 0 has {tuple(tensors[0].shape[1:])}"
            )
        tensors.append(t)
    out = None
    first = tensors[0]
    if torch.utils.data.get_worker_info() is not None and all(t.dtype == first.dtype and t.device == first.device for t in tensors):
        # in a DataLoader worker, straight into shared memory (as torch's default collate does), so
        # that the batch is not copied once more to reach the main process
        storage = first._typed_storage()._new_shared(sum(t.numel() for t in tensors), device=first.device)
        out = first.new(storage).resize_(sum(t.shape[0] for t in tensors), *first.shape[1:])
    x = torch.cat(tensors, 0, out=out)
    sizes = [t.shape[0] for t in tensors]
    return x, bag_index_from_sizes(sizes, device=x.device)


def split_by_bag(values: Tensor, bag_index: Tensor, num_bags: int | None = None) -> list[Tensor]:
    """Inverse of :func:`flatten_bags`: a list of per-bag tensors (for user-facing outputs)."""
    bags = Bags.from_index(bag_index, num_bags)
    return list(torch.split(values[bags.padding.order], bags.sizes.tolist()))


def to_padded(x: Tensor, bags: Bags, fill: float = 0.0, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dense ``(B, N_max, ...)`` tensor and boolean mask ``(B, N_max)`` (``True`` = real instance)
    of the instances ``x`` ``(N, ...)`` of ``bags``, or of ``x[rows]`` (one gather, no copy of
    ``x[rows]``) when ``rows`` ``(N,)`` picks them from a larger ``x``.

    Instances keep their order within each bag. Only for operators that need dense input.
    """
    pad = bags.padding
    padded = x.new_full((bags.num_bags, pad.n_max) + tuple(x.shape[1:]), fill)
    padded[pad.bag, pad.position] = x[pad.order if rows is None else rows[pad.order]]
    mask = torch.zeros(bags.num_bags, pad.n_max, dtype=torch.bool, device=x.device)
    mask[pad.bag, pad.position] = True
    return padded, mask


def identity_padded(cov: Tensor, mask: Tensor) -> Tensor:
    """Padded per-bag matrices ``(B, N_max, N_max)`` with the padded rows and columns replaced by the
    identity (so a padded block stays positive definite and factorises) and exactly symmetrised;
    ``mask`` ``(B, N_max)`` as from :func:`to_padded`."""
    eye = torch.eye(mask.shape[1], dtype=cov.dtype, device=cov.device)
    pair = mask.unsqueeze(-1) & mask.unsqueeze(-2)
    cov = torch.where(pair, cov, eye.expand_as(cov))
    return 0.5 * (cov + cov.mT)


def from_padded(padded: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`to_padded`: ``(x (N, ...), bag_index (N,))`` from the real entries."""
    bag_index = torch.nonzero(mask, as_tuple=True)[0]
    return padded[mask], bag_index


_TENSOR_FIELDS = ("x", "bag_index", "bag_labels", "instance_labels", "instance_weights")
"""The tensor fields of :class:`BagBatch` (what :meth:`BagBatch.to` and :meth:`BagBatch.pin_memory` move)."""


@dataclass
class BagBatch:
    """A minibatch of whole bags in the flat representation.

    Attributes:
        x: ``(N, ...)`` instances (features ``(N, D)`` or slices ``(N, C, H, W)``).
        bag_index: ``(N,)`` long, values ``0..B-1``.
        bag_labels: ``(B,)`` bag targets (``{0, 1}`` for MIL, real values for aggregates).
        instance_labels: ``(N,)`` instance labels where known, else ``None``.
        instance_weights: ``(N,)`` populations / weights (aggregate outputs), else ``None``.
        bag_ids: ``B`` identifiers (scan ids, file stems) or ``None``.
    """

    x: Tensor
    bag_index: Tensor
    bag_labels: Tensor
    instance_labels: Tensor | None = None
    instance_weights: Tensor | None = None
    bag_ids: list[str] | None = field(default=None)

    @property
    def num_bags(self) -> int:
        return int(self.bag_labels.shape[0])

    @property
    def num_instances(self) -> int:
        return int(self.x.shape[0])

    @cached_property
    def bags(self) -> Bags:
        """The batch's :class:`Bags` (built once per batch)."""
        return Bags(self.bag_index, self.num_bags)

    def check(self) -> "BagBatch":
        """This batch, or a one-line ``ValueError`` naming the field unless ``bag_index`` is a
        long ``(N,)`` tensor for the ``N`` instances of ``x`` whose values are the bags
        ``0..B-1`` of the ``B`` bag labels, each at least once (a batch built by hand with 1-based
        bag ids, or with labels of bags that lost their instances), and ``x`` is finite (a NaN ended
        in a Cholesky error naming no instance). One device synchronisation:
        the fits call it once, not per step."""
        index, n, num_bags = self.bag_index, self.num_instances, self.num_bags
        check_bag_index_dtype(index)
        if tuple(index.shape) != (n,):
            raise ValueError(f"bag_index has shape {tuple(index.shape)}; it must be ({n},), the bag of each instance of x")
        if self.instance_weights is not None and tuple(self.instance_weights.shape) != (n,):
            raise ValueError(f"instance_weights has shape {tuple(self.instance_weights.shape)}; it must be ({n},), one per instance of x")
        if self.bag_labels.dim() != 1 or num_bags == 0 or n == 0:
            raise ValueError(f"a batch needs bag_labels (B,) with B >= 1 and instances, got bag_labels of shape {tuple(self.bag_labels.shape)} and {n} instances")
        sizes = bag_sizes(index.clamp(0, num_bags - 1), num_bags)  # clamped: an out-of-range id is reported below
        finite = torch.isfinite(self.x).reshape(n, -1).all(dim=1)
        low, high, num_empty, num_bad = torch.stack(
            [index.min(), index.max(), (sizes == 0).sum(), (~finite).sum()]
        ).tolist()  # the one synchronisation
        if num_bad:
            first = int(torch.nonzero(~finite)[0])
            raise ValueError(f"x has NaN or inf features in instance {first} (bag {int(index[first])}; {num_bad} such instance(s) in all)")
        if low < 0 or high >= num_bags:
            raise ValueError(f"bag_index holds bag {low if low < 0 else high}, but the {num_bags} bag labels name bags 0..{num_bags - 1}")
        if num_empty:
            empty = torch.nonzero(sizes == 0).flatten()
            raise ValueError(f"bag {int(empty[0])} has a label but no instances (bag_index never takes that value; {empty.numel()} such bag(s) in all)")
        return self

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None, non_blocking: bool = False) -> "BagBatch":
        """Move tensors to ``device``; ``dtype`` applies to floating ``x`` and weights only.
        ``non_blocking``: copy asynchronously (from pinned memory, :meth:`pin_memory`, to a GPU)."""

        def move(t: Tensor, f: str) -> Tensor:
            cast = dtype is not None and f in ("x", "instance_weights") and t.is_floating_point()
            return t.to(device=device, dtype=dtype if cast else None, non_blocking=non_blocking)

        return replace(self, **{f: move(t, f) for f in _TENSOR_FIELDS if (t := getattr(self, f)) is not None})

    def pin_memory(self) -> "BagBatch":
        """This batch with its tensors in page-locked host memory, so that ``to(gpu,
        non_blocking=True)`` copies while the GPU computes (a ``DataLoader`` with
        ``pin_memory=True`` calls this in its pinning thread)."""
        return replace(self, **{f: t.pin_memory() for f in _TENSOR_FIELDS if (t := getattr(self, f)) is not None})

    def select_bags(self, bags: Tensor | Sequence[int]) -> "BagBatch":
        """The sub-batch holding the given bags (re-indexed ``0..len(bags)-1``)."""
        return self.select_bags_with_index(bags)[0]

    def select_bags_with_index(self, bags: Tensor | Sequence[int]) -> tuple["BagBatch", Tensor]:
        """:meth:`select_bags` and the indices ``(n_sub,)`` of its instances in this batch (so that
        per-instance state, e.g. VGPMIL's π, can be gathered and scattered back)."""
        bags_t = torch.as_tensor(bags, dtype=torch.long, device=self.bag_index.device)
        remap = torch.full((self.num_bags,), -1, dtype=torch.long, device=self.bag_index.device)
        remap[bags_t] = torch.arange(len(bags_t), device=bags_t.device)
        new_index = remap[self.bag_index]
        keep = new_index >= 0
        order = torch.argsort(new_index[keep], stable=True)
        idx = torch.nonzero(keep, as_tuple=True)[0][order]
        sub = replace(
            self,
            **{f: t[idx] for f in ("x", "instance_labels", "instance_weights") if (t := getattr(self, f)) is not None},
            bag_index=new_index[idx],
            bag_labels=self.bag_labels[bags_t],
            bag_ids=None if self.bag_ids is None else [self.bag_ids[int(b)] for b in bags_t],
        )
        return sub, idx


def collate_bags(samples: Sequence[Any]) -> BagBatch:
    """Collate bags into a :class:`BagBatch` (for ``DataLoader(collate_fn=collate_bags)``).

    Each sample is a tuple ``(instances (n_b, ...), instance_labels (n_b,) or None, bag_label,
    bag_id)`` (the last two entries optional) or a mapping with keys ``x``, ``instance_labels``,
    ``bag_label``, ``bag_id``, ``instance_weights``.
    """
    fields = ("x", "instance_labels", "bag_label", "bag_id")
    samples = [s if isinstance(s, dict) else dict(zip(fields, s)) for s in samples]
    x, bag_index = flatten_bags([torch.as_tensor(s["x"]) for s in samples])

    def per_instance(key: str) -> Tensor | None:
        parts = [s.get(key) for s in samples]
        return None if any(p is None for p in parts) else torch.cat([torch.as_tensor(p).reshape(-1) for p in parts])

    instance_labels, instance_weights = per_instance("instance_labels"), per_instance("instance_weights")
    bag_labels = torch.as_tensor(np.asarray([float(s.get("bag_label", 0)) for s in samples]))
    ids = [s.get("bag_id") for s in samples]
    bag_ids = None if all(i is None for i in ids) else [str(i) for i in ids]
    return BagBatch(x, bag_index, bag_labels, instance_labels, instance_weights, bag_ids)


class BagBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields lists of whole-bag indices (minibatches of bags), optionally shuffled.

    Use as ``DataLoader(dataset, batch_sampler=BagBatchSampler(len(dataset), 8))`` with a dataset
    whose items are bags, or directly to pick bags for :meth:`BagBatch.select_bags`.
    """

    def __init__(self, num_bags: int, bags_per_batch: int, shuffle: bool = True, drop_last: bool = False, seed: int = 0):
        if num_bags < 1:
            raise ValueError("num_bags must be at least 1")
        if bags_per_batch < 1:
            raise ValueError("bags_per_batch must be at least 1")
        self.num_bags = num_bags
        self.bags_per_batch = bags_per_batch
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.num_bags, generator=self.generator) if self.shuffle else torch.arange(self.num_bags)
        for start in range(0, self.num_bags, self.bags_per_batch):
            chunk = order[start : start + self.bags_per_batch]
            if self.drop_last and len(chunk) < self.bags_per_batch:
                return
            yield chunk.tolist()

    def __len__(self) -> int:
        full, rest = divmod(self.num_bags, self.bags_per_batch)
        return full if (self.drop_last or rest == 0) else full + 1


@dataclass
class BagGroup:
    """A chunk of whole bags: instance indices ``(n_g,)`` (bag by bag), local bag index
    ``(n_g,)`` in ``0..B_g−1`` and the global ids of its bags ``(B_g,)``."""

    inst: Tensor
    local: Tensor
    bags: Tensor

    @property
    def num_bags(self) -> int:
        return int(self.bags.shape[0])

    @cached_property
    def local_bags(self) -> Bags:
        """The group's own bags: :class:`Bags` of :attr:`local`."""
        return Bags(self.local, self.num_bags)


def make_bag_groups(
    bags: Bags,
    chunk_instances: int = 32768,
    block_budget: int | None = None,
    subset: Tensor | None = None,
) -> list[BagGroup]:
    """Pack the bags (or the bags ``subset``) into groups of whole bags, smallest bags first.

    A group holds at most ``chunk_instances`` instances and, with ``block_budget``, at most that
    many entries of its padded within-bag blocks (``B_g · n_max²``), so work on padded per-bag
    covariances has bounded memory whatever the bag sizes, and at most twice the entries of its
    bags' own blocks (``Σ n_b²``), so padding short bags to a long one's length never more than
    doubles that work however widely the sizes spread; a bag larger than either bound forms a group
    of its own. :meth:`Bags.groups` keeps the groups of all bags.
    """
    device = bags.index.device
    sizes = bags.sizes
    perm, starts = bags.padding.order, bags.padding.starts
    chosen = torch.arange(bags.num_bags, device=device) if subset is None else torch.as_tensor(subset, device=device)
    chosen = chosen[torch.argsort(sizes[chosen], stable=True)]
    sizes_l = sizes[chosen].tolist()
    groups, current, n_inst, n_entries = [], [], 0, 0
    for b, n in zip(chosen.tolist(), sizes_l):
        padded = (len(current) + 1) * n * n  # the group's block entries with bag b, its largest
        over_inst = current and n_inst + n > chunk_instances
        over_block = current and block_budget is not None and (padded > block_budget or padded > 2 * (n_entries + n * n))
        if over_inst or over_block:
            groups.append(current)
            current, n_inst, n_entries = [], 0, 0
        current.append(b)
        n_inst += n
        n_entries += n * n
    if current:
        groups.append(current)
    out = []
    for g in groups:
        g_t = torch.as_tensor(g, dtype=torch.long, device=device)
        g_sizes = sizes[g_t]
        local = torch.repeat_interleave(torch.arange(len(g), device=device), g_sizes)
        offsets = torch.arange(int(g_sizes.sum()), device=device) - torch.repeat_interleave(torch.cumsum(g_sizes, 0) - g_sizes, g_sizes)
        inst = perm[starts[g_t][local] + offsets]
        out.append(BagGroup(inst=inst, local=local, bags=g_t))
    return out
