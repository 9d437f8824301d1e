"""A small MobileNet (`mobilenet_small`): MobileNetV2 (Sandler, Howard, Zhu, Zhmoginov, Chen 2018, "MobileNetV2:
Inverted Residuals and Linear Bottlenecks", arXiv:1801.04381) at width multiplier 0.5 and CIFAR shape, with
BatchNorm with running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167; FedBN, Li et al. 2021,
arXiv:2102.07623, keeps it local). Built by `fedprism.models._resnet.MobileNetSmall`.

Decisions where the paper is silent on CIFAR: the stem and the second inverted-residual row run at stride 1
(`MOBILENET_ROWS`), so a 32x32 image ends at 4x4; width 0.5 (every row's channels halved and rounded to a
multiple of 8, as the paper's width multiplier) and a last 1x1 convolution of 640 channels (half the
paper's 1280), so the model has about 0.6 M parameters, between ResNet-20 and ResNet-18."""

from __future__ import annotations

from fedprism.models._resnet import MobileNetSmall, refuse_small
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "mobilenet_small", lambda shape, k: MobileNetSmall(shape[0], k),
    title="MobileNetV2 at width 0.5, CIFAR shape (Sandler et al. 2018, arXiv:1801.04381), BatchNorm with running "
          "statistics",
    inputs="[C, H, W] images with H, W >= 8 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("mobilenet_small", 8), conv=False,
    body="conv3x3(16)-BN, 17 inverted residuals (t=6) x 8..160, conv1x1(640)-BN, avgpool", head="fc(classes)",
    shape=(3, 32, 32)))
