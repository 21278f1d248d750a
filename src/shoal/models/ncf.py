"""Neural collaborative filtering for implicit feedback: NeuMF, the fusion of generalized matrix
factorization and an MLP over user/item embeddings (He et al. 2017, "Neural Collaborative
Filtering", section 3.4).

Training batches are {"user": (B,), "item": (B,), "label": (B,) float 0/1} (positives plus sampled
negatives). Evaluation batches are {"user": (B,), "candidates": (B, 100)} where candidate 0 is the
held-out positive and 99 are unseen items: the paper's leave-one-out protocol, reported as HR@10.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from shoal.models.spec import Batch, DataSpec, ModelBundle, ModelSection

HIT_K = 10


class NCFConfig(ModelSection):
    """NeuMF recommender for implicit feedback; trains on interactions, reports HR@10."""

    data_kinds: ClassVar = ("interactions",)
    name: Literal["ncf"] = "ncf"
    embed_dim: int = Field(16, ge=1)
    """Embedding size of the GMF branch; the MLP branch's embeddings are twice as wide."""
    mlp_layers: list[int] = Field(default_factory=lambda: [64, 32, 16], min_length=1)
    """Hidden sizes of the MLP tower."""


class NeuMF(nn.Module):
    def __init__(self, cfg: NCFConfig, num_users: int, num_items: int):
        super().__init__()
        d = cfg.embed_dim
        self.user_gmf, self.item_gmf = nn.Embedding(num_users, d), nn.Embedding(num_items, d)
        self.user_mlp, self.item_mlp = nn.Embedding(num_users, 2 * d), nn.Embedding(num_items, 2 * d)
        layers, width = [], 4 * d
        for h in cfg.mlp_layers:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(d + width, 1)
        for emb in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            nn.init.normal_(emb.weight, std=0.01)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        """Logits of interaction; user and item broadcast against each other, shape (...)."""
        user, item = torch.broadcast_tensors(user, item)
        gmf = self.user_gmf(user) * self.item_gmf(item)  # (..., d)
        mlp = self.mlp(torch.cat([self.user_mlp(user), self.item_mlp(item)], dim=-1))  # (..., last)
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


def bce_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch["user"], batch["item"]).float()
    return F.binary_cross_entropy_with_logits(logits, batch["label"], reduction="sum")


def hit_rate_eval(model: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    cand = batch["candidates"]  # (B, 100), column 0 is the held-out positive
    logits = model(batch["user"][:, None], cand).float()  # (B, 100)
    labels = torch.zeros_like(logits)
    labels[:, 0] = 1.0
    # rank of the positive = how many candidates score strictly higher
    rank = (logits[:, 1:] > logits[:, :1]).sum(dim=1)
    n = torch.tensor(len(cand))
    return {"loss": (F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / cand.shape[1], n),
            f"hit_rate@{HIT_K}": ((rank < HIT_K).sum(), n)}


def build(cfg: NCFConfig, spec: DataSpec) -> ModelBundle:
    return ModelBundle(NeuMF(cfg, spec.num_users, spec.num_items), bce_loss, eval_fn=hit_rate_eval)
