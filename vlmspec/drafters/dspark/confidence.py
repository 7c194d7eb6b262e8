"""The confidence head: one conditional survival probability per draft position.

``c_k`` estimates P(draft token k survives verification | tokens 1..k-1 survived); the
scheduler multiplies them into prefix survival probabilities ``a_k = prod_{i<=k} c_i``.
It sees only what exists before x_k is drawn (the backbone state and the previous
token), so a scheduler using it stays non-anticipating.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmspec.drafters.dspark.config import DSparkConfig


class ConfidenceHead(nn.Module):
    """``c_k = sigmoid(w . [h_k ; W1[x_{k-1}]])`` (or over ``h_k`` alone): P(position k survives | earlier ones did)."""

    def __init__(self, config: DSparkConfig, token_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + token_dim, 1)

    def logits(
        self,
        hidden: torch.Tensor,  # [B, G, d]
        prev_features: torch.Tensor | None,  # [B, G, r] head embedding of the previous tokens, or None
    ) -> torch.Tensor:  # [B, G] float32 pre-sigmoid scores (for a BCE-with-logits loss)
        x = hidden if prev_features is None else torch.cat((hidden, prev_features), dim=-1)
        return self.proj(x).squeeze(-1).float()

    def forward(self, hidden: torch.Tensor, prev_features: torch.Tensor | None) -> torch.Tensor:  # [B, G] float32
        return torch.sigmoid(self.logits(hidden, prev_features))
