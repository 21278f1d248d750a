"""A small ResNet for small images (He et al. 2016, "Deep Residual Learning", the CIFAR variant:
three stages of basic blocks at widths w, 2w, 4w, global average pooling, one linear classifier).
Two stages halve the resolution and the pooling takes any size left, so 32x32 CIFAR and 8x8 digit
scans both fit (image_size >= 4).

Batches are {"image": (B, 3, H, W) float32, "label": (B,) int64}. BatchNorm statistics are per
micro-batch and per rank, as in plain DDP, so layouts agree only approximately for this model.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from shoal.models.spec import Batch, DataSpec, ModelBundle, ModelSection


class ResNetConfig(ModelSection):
    """Small CIFAR-style ResNet classifier; trains on images (synthetic-images, image-folder, cifar10)."""

    data_kinds: ClassVar = ("images",)
    name: Literal["resnet"] = "resnet"
    width: int = Field(16, ge=4)
    """Channels of the first stage; later stages double it."""
    blocks_per_stage: int = Field(1, ge=1)
    """Basic blocks per stage (1 gives ResNet-8, 3 gives ResNet-20)."""


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:  # projection shortcut (option B in the paper)
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig, num_classes: int):
        super().__init__()
        w = cfg.width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        blocks, c = [], w
        for stage, c_out in enumerate((w, 2 * w, 4 * w)):
            for i in range(cfg.blocks_per_stage):
                blocks.append(BasicBlock(c, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))  # (B, 4w, H/4, W/4)
        return self.fc(x.mean(dim=(2, 3)))  # (B, classes)


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]).float(), batch["label"], reduction="sum")


def classification_eval(model: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    logits = model(batch["image"]).float()
    n = torch.tensor(len(logits))
    return {"loss": (F.cross_entropy(logits, batch["label"], reduction="sum"), n),
            "accuracy": ((logits.argmax(-1) == batch["label"]).sum(), n)}


def build(cfg: ResNetConfig, spec: DataSpec) -> ModelBundle:
    return ModelBundle(ResNet(cfg, spec.num_classes), classification_loss, eval_fn=classification_eval,
                       block_types=(BasicBlock,))
