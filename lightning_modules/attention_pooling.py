"""Attention-based MIL pooling (Ilse, Tomczak & Welling, 2018), on flat bags with a bag index."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from milgp.data.bags import Bags, segment_sum, to_padded

__all__ = ["AttentionPooling"]


class AttentionPooling(nn.Module):
    """Attention (``gated=False``) or gated attention (``gated=True``) pooling.

    Scores ``a_n = wᵀ tanh(V h_n)`` or ``wᵀ (tanh(V h_n) ⊙ sigmoid(U h_n))``; weights are the softmax
    of the scores within each bag; the bag embedding is ``Σ_n w_n h_n``.

    The softmax is the only dense operation: the scores ``(N,)`` are padded to ``(B, N_max)`` with
    :func:`milgp.data.bags.to_padded`, padded entries masked to ``−inf`` (weight exactly 0), and
    the weights mapped back to the flat instances. Padded rows never exist for the features.

    Args:
        in_dim: D, the instance feature dimension.
        hidden_dim: L, the attention hidden size.
        gated: use the gated variant.
    """

    def __init__(self, in_dim: int, hidden_dim: int = 64, gated: bool = True):
        super().__init__()
        self.V = nn.Linear(in_dim, hidden_dim)
        self.U = nn.Linear(in_dim, hidden_dim) if gated else None
        self.w = nn.Linear(hidden_dim, 1)
        self.gated = gated

    def scores(self, h: Tensor) -> Tensor:
        """Unnormalised attention scores ``(N,)``."""
        a = torch.tanh(self.V(h))
        if self.U is not None:
            a = a * torch.sigmoid(self.U(h))
        return self.w(a).squeeze(-1)

    def forward(self, h: Tensor, bags: Bags) -> tuple[Tensor, Tensor]:
        """``h (N, D)`` of ``bags`` → ``(bag embeddings (B, D), attention weights (N,))``."""
        s, pad = self.scores(h).float(), bags.padding
        s_pad, _ = to_padded(s, bags, fill=float("-inf"))
        weights = torch.empty_like(s)  # every bag has >= 1 real entry, so the softmax has no NaN
        weights[pad.order] = torch.softmax(s_pad, dim=1)[pad.bag, pad.position]
        pooled = segment_sum(weights.to(h.dtype).unsqueeze(-1) * h, bags.index, bags.num_bags)
        return pooled, weights
