"""What the ResNet and MobileNet models share: their normalisation choice and their blocks.

The model modules (`resnet18`, `resnet18_gn`, `resnet20`, `resnet20_gn`, `resnet8`, `resnet8_gn`,
`mobilenet_small`) each declare one `ModelSpec`; this module (skipped by the registry: its name starts with
an underscore) builds them.

Decisions where the papers leave room:

* Normalisation. `bn`: BatchNorm with running statistics (`RunningBatchNorm2d`: batch statistics in
  training, running statistics in evaluation, the running statistics part of the model's vector:
  docs/architecture.md, "BatchNorm and the flat vector"), as in He et al. and in other libraries. `gn`:
  GroupNorm (Wu & He 2018, "Group Normalization", arXiv:1803.08494) with 2 groups per layer, the choice of
  Reddi et al. 2021 ("Adaptive Federated Optimization", arXiv:2003.00295) for their federated ResNets
  (and of Hsieh et al. 2020, "The Non-IID Data Quagmire of Decentralized Machine Learning",
  arXiv:1910.00189, who show why BatchNorm's statistics suffer under non-IID clients): no statistics at
  all, so a `_gn` model behaves the same in training and evaluation and its vector holds parameters only.
  Variants are separate model names, not a model option, so a run id names its model completely and
  `fedprism models` lists both.
* Initialisation: PyTorch's defaults for convolutions and linear layers (kaiming-uniform with a=sqrt(5)),
  normalisation weight 1 and bias 0, drawn under the run seed; the papers' He-normal initialisation is not
  reproduced (the libraries FL papers use, e.g. the CIFAR ResNets of pytorch-cifar, keep the defaults).
* The body ends with global average pooling and flattening (the penultimate features); the head is the
  final linear layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedprism.models.base import RunningBatchNorm2d, Split

NORMS = ("bn", "gn")
GN_GROUPS = 2


def norm(kind: str, channels: int) -> nn.Module:
    """The normalisation layer of `kind` (see the module docstring)."""
    if kind == "bn":
        return RunningBatchNorm2d(channels)
    if kind == "gn":
        return nn.GroupNorm(GN_GROUPS, channels)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class BasicBlock(nn.Module):
    """He et al. 2016 (arXiv:1512.03385), Figure 2: conv3x3-norm-ReLU-conv3x3-norm, plus the shortcut,
    then ReLU. `shortcut`: "B" projects with a 1x1 convolution and a norm layer where the shape changes
    (ResNet-18), "A" subsamples and pads the new channels with zeros, adding no parameter (the paper's
    CIFAR-10 networks, section 4.2)."""

    def __init__(self, cin: int, cout: int, stride: int, kind: str, shortcut: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = norm(kind, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = norm(kind, cout)
        self.pad = 0
        self.stride = stride
        self.proj: nn.Module | None = None
        if stride != 1 or cin != cout:
            if shortcut == "B":
                self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(kind, cout))
            else:
                self.pad = cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        if self.proj is not None:
            sc = self.proj(x)
        elif self.stride != 1 or self.pad:
            sc = x[:, :, ::self.stride, ::self.stride]
            if self.pad:
                sc = F.pad(sc, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        else:
            sc = x
        return F.relu(out + sc)


class CifarResNet(Split):
    """A ResNet of BasicBlocks at CIFAR shape: a 3x3 stem convolution with stride 1 and no max-pooling,
    stages of `blocks[i]` blocks of `widths[i]` channels (the first stage at stride 1, each later one
    halving the map), global average pooling (the body's end) and one linear layer (the head)."""

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...], blocks: tuple[int, ...],
                 kind: str, shortcut: str):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), norm(kind, widths[0]),
                                   nn.ReLU()]
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(BasicBlock(cin, w, 2 if i > 0 and j == 0 else 1, kind, shortcut))
                cin = w
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(cin, num_classes))


def resnet18(in_channels: int, num_classes: int, kind: str) -> CifarResNet:
    """ResNet-18 (He et al. 2016, arXiv:1512.03385, Table 1) in its CIFAR form: 3x3 stem at stride 1, no
    max-pooling, BasicBlocks [2, 2, 2, 2] of 64, 128, 256, 512 channels, projection shortcuts (B)."""
    return CifarResNet(in_channels, num_classes, (64, 128, 256, 512), (2, 2, 2, 2), kind, "B")


def resnet_cifar(depth: int, in_channels: int, num_classes: int, kind: str) -> CifarResNet:
    """The CIFAR-10 ResNets of He et al. 2016 (arXiv:1512.03385, section 4.2): depth 6n + 2, three stages
    of n BasicBlocks with 16, 32 and 64 channels, identity shortcuts with zero padding (A)."""
    if (depth - 2) % 6:
        raise ValueError(f"a CIFAR ResNet has depth 6n + 2, got {depth}")
    n = (depth - 2) // 6
    return CifarResNet(in_channels, num_classes, (16, 32, 64), (n, n, n), kind, "A")


def refuse_small(name: str, least: int):
    """`ModelSpec.refuse` for [C, H, W] images of at least `least` pixels a side (global average pooling
    takes any size; below `least` the strided stages leave maps of less than one pixel)."""
    def refuse(shape: tuple[int, ...]) -> str | None:
        if len(shape) != 3 or min(shape[1:]) < least:
            return f"{name} needs [C, H, W] images with H, W >= {least}, data has {list(shape)}"
        return None
    return refuse


def make_divisible(v: float, d: int = 8) -> int:
    """MobileNetV2's channel rounding (the reference implementation's `_make_divisible`): the multiple of d
    nearest v, at least d, never below 0.9 v."""
    out = max(d, int(v + d / 2) // d * d)
    return out + d if out < 0.9 * v else out


class InvertedResidual(nn.Module):
    """MobileNetV2's block (Sandler et al. 2018, arXiv:1801.04381, Table 1): 1x1 expansion by t (absent
    for t = 1), 3x3 depthwise convolution with the stride, 1x1 linear projection, each followed by
    BatchNorm, ReLU6 after the first two; the residual connection where stride is 1 and the width stays."""

    def __init__(self, cin: int, cout: int, stride: int, t: int):
        super().__init__()
        hid = cin * t
        layers: list[nn.Module] = []
        if t != 1:
            layers += [nn.Conv2d(cin, hid, 1, bias=False), RunningBatchNorm2d(hid), nn.ReLU6()]
        layers += [nn.Conv2d(hid, hid, 3, stride, 1, groups=hid, bias=False), RunningBatchNorm2d(hid), nn.ReLU6(),
                   nn.Conv2d(hid, cout, 1, bias=False), RunningBatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


#: MobileNetV2's (t, c, n, s) rows (Sandler et al. 2018, Table 2), at CIFAR shape: the stem and the second
#: row at stride 1 instead of 2, so a 32x32 image ends at 4x4, as the ImageNet network's 224 ends at 7x7
MOBILENET_ROWS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                  (6, 320, 1, 1))


class MobileNetSmall(Split):
    """MobileNetV2 (Sandler et al. 2018, arXiv:1801.04381) at width multiplier `width` and CIFAR shape
    (`MOBILENET_ROWS`): conv3x3(32 w)-BN-ReLU6, the inverted-residual rows, conv1x1 to `last` channels
    -BN-ReLU6, global average pooling (the body), a linear layer (the head). No dropout (the paper's
    classifier has none)."""

    def __init__(self, in_channels: int, num_classes: int, width: float = 0.5, last: int = 640):
        super().__init__()
        cin = make_divisible(32 * width)
        layers: list[nn.Module] = [nn.Conv2d(in_channels, cin, 3, 1, 1, bias=False), RunningBatchNorm2d(cin),
                                   nn.ReLU6()]
        for t, c, n, s in MOBILENET_ROWS:
            cout = make_divisible(c * width)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers += [nn.Conv2d(cin, last, 1, bias=False), RunningBatchNorm2d(last), nn.ReLU6(),
                   nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(last, num_classes))
