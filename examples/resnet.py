"""A small ResNet-style conv net: stem (conv + BatchNorm + ReLU), two residual blocks with
BatchNorm (the second downsamples), adaptive average pooling and a Linear head."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


NUM_CLASSES = 10


def build(
    width: int = 16, batch: int = 8, image: int = 32, device: str | torch.device = "cpu"
) -> tuple[ResNet, tuple[torch.Tensor]]:
    """A ResNet and its example input ``(batch, 3, image, image)`` float32."""
    torch.manual_seed(0)
    with torch.device(device):
        model = ResNet(width, NUM_CLASSES)
        x = torch.randn(batch, 3, image, image)
    return model, (x,)


def loss_fn(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against fixed labels: sample i has class i mod NUM_CLASSES."""
    labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[1]
    return F.cross_entropy(logits, labels)


model, example_inputs = build()
