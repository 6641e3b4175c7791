"""Models shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RefNet(torch.nn.Module):
    """The Python twin of kfac._kfac's C++ RefNet (same module names, same forward): Conv2d with
    stride, padding and dilation, BatchNorm2d, Conv2d without bias, Linear with and without bias."""

    def __init__(self, flat: int = 5 * 4 * 6, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2))
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 5, 3, padding=1, bias=False)
        self.fc1 = torch.nn.Linear(flat, 6)
        self.fc2 = torch.nn.Linear(6, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.conv2(h)).flatten(1)
        return self.fc2(F.relu(self.fc1(h)))


def ref_batch(n: int, dtype: torch.dtype, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """RefNet's input: (n, 3, 8, 6) -> conv1 (n, 4, 4, 6)."""
    return torch.randn(n, 3, 8, 6, dtype=dtype), torch.randint(0, classes, (n,))


class ConvLinear(torch.nn.Module):
    """Conv2d then Linear, no BatchNorm (its batch statistics differ between micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.fc = torch.nn.Linear(3 * 5 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).flatten(1))


class Sequence(torch.nn.Module):
    """(B, T, 4) tokens: a Linear over tokens, a LayerNorm, the tokens pooled, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.fc(x))).mean(1))


class TokenIds(torch.nn.Module):
    """(B, T) token ids: an Embedding with a padding index, the tokens pooled, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(9, 5, padding_idx=0)
        self.head = torch.nn.Linear(5, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
