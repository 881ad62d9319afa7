"""The local variational parameters of training bags, kept by bag id across minibatches, epochs,
processes and checkpoints."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from milgp.data.bags import Bags, split_by_bag

__all__ = ["BagLocals"]

BagIds = Sequence[str | int] | Tensor | np.ndarray
"""Bag ids, one per bag: strings, or integers (a list, an array or a tensor ``(B,)``)."""


class BagLocals(nn.Module):
    """The per-instance locals of every training bag seen so far (VGPMIL's ``π_n = q(y_n = 1)``, the
    probit model's ``ν_n``, …), by bag id.

    In stochastic variational inference the local parameters of a data point are re-optimised
    whenever it is drawn (Hoffman, Blei, Wang & Paisley, *Stochastic variational inference*, JMLR
    2013, Algorithm 1); VGPMIL's ``q(y)`` update is a damped fixed-point step, so a bag drawn again
    (later minibatch or epoch, another DDP rank) continues from its own locals. Held on CPU in
    float64. A bag must come back with its instances in the same order (locals are kept by position).

    Its ``state_dict`` holds three tensors whatever the number of bags — ``ids`` (the bag ids as
    NUL-separated UTF-8 bytes, sorted), ``sizes`` ``(B,)`` and ``values`` ``(Σ n_b,)`` — loadable with
    ``torch.load(weights_only=True)``; their shapes are the stored bags' (:attr:`resizes_on_load`).
    Integer bag ids (:data:`BagIds`) are kept under their decimal string: ``7`` and ``"7"`` are one bag.
    """

    resizes_on_load = True
    _KEYS = ("ids", "sizes", "values")

    def __init__(self, by_id: Mapping[str, Tensor] | None = None) -> None:
        super().__init__()
        self._by_id: dict[str, Tensor] = {k: v.to(torch.float64) for k, v in (by_id or {}).items()}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, bag_id: object) -> bool:
        return bag_id in self._by_id

    def __getitem__(self, bag_id: str) -> Tensor:
        return self._by_id[bag_id]

    def ids(self) -> list[str]:
        """The ids of the stored bags, sorted."""
        return sorted(self._by_id)

    def gather(self, bag_ids: BagIds | None, bags: Bags) -> Tensor | None:
        """The stored locals ``(N,)`` of a batch's bags (ids in the order of ``bags``) in its
        instance order, on its device; ``None`` unless every bag has stored locals of its size (the
        fit then initialises them)."""
        keys = _keys(bag_ids, bags)
        if not keys or not all(b in self._by_id for b in keys):
            return None
        parts = [self._by_id[b] for b in keys]
        if [len(p) for p in parts] != bags.sizes.tolist():
            return None
        out = torch.empty(bags.index.shape[0], dtype=torch.float64, device=bags.index.device)
        out[bags.padding.order] = torch.cat(parts).to(out.device)  # the instances sorted by bag
        return out

    def store(
        self, bag_ids: BagIds | None, bags: Bags, locals_: Any, gather: Callable[[Any], list[Any]] | None = None
    ) -> None:
        """Keep a batch's locals ``(N,)`` by bag id; nothing when they are not one value per
        instance (e.g. an aggregate likelihood's ``None``). ``gather`` collects every process's list
        of ``(id, locals)`` pairs (a DDP all-gather), so that every rank holds every bag's locals."""
        keys = _keys(bag_ids, bags)
        if not keys or not isinstance(locals_, Tensor) or locals_.shape != bags.index.shape:
            return
        parts = [(b, p.cpu().to(torch.float64, copy=True)) for b, p in zip(keys, split_by_bag(locals_.detach(), bags.index, bags.num_bags))]
        if gather is not None:
            parts = [pair for process_parts in gather(parts) for pair in process_parts]
        self._by_id.update(parts)

    def cat(self, bag_ids: BagIds) -> Tensor:
        """The stored locals of ``bag_ids``, concatenated in that order (``KeyError`` for a bag
        without locals)."""
        return torch.cat([self._by_id[b] for b in _keys(bag_ids)])

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        ids = self.ids()
        destination[prefix + "ids"] = torch.tensor(list("\0".join(ids).encode()), dtype=torch.uint8)
        destination[prefix + "sizes"] = torch.tensor([len(self._by_id[b]) for b in ids], dtype=torch.long)
        destination[prefix + "values"] = torch.cat([self._by_id[b] for b in ids]) if ids else torch.zeros(0, dtype=torch.float64)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        keys = [prefix + k for k in self._KEYS]
        missing = [k for k in keys if k not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        raw, sizes, values = (state_dict[k] for k in keys)
        ids = bytes(raw.tolist()).decode().split("\0") if len(sizes) else []
        if len(ids) != len(sizes) or int(sizes.sum()) != len(values):
            error_msgs.append(f"{prefix}values: {len(values)} locals, {len(ids)} ids and {len(sizes)} sizes (summing to {int(sizes.sum())}) do not agree")
            return
        self._by_id = dict(zip(ids, values.to(torch.float64, copy=True).split(sizes.tolist())))


def _keys(bag_ids: BagIds | None, bags: Bags | None = None) -> list[str]:
    """The store's keys of ``bag_ids`` (strings; integers as their decimal string); ``[]`` for
    ``None``. With ``bags``, one id per bag or a one-line ``ValueError``."""
    if bag_ids is None:
        return []
    values = bag_ids.tolist() if isinstance(bag_ids, (Tensor, np.ndarray)) else list(bag_ids)
    if bags is not None and values and len(values) != bags.num_bags:
        raise ValueError(f"bag_ids: {len(values)} ids for a batch of {bags.num_bags} bags (one id per bag, in the order of the bags)")
    return [b if isinstance(b, str) else str(b) for b in values]
