"""ResNet-20 (`resnet20`), the CIFAR-10 network of He, Zhang, Ren, Sun 2016, "Deep Residual Learning for
Image Recognition", arXiv:1512.03385 (section 4.2, n = 3: 16/32/64 channels, zero-padding shortcuts), with
BatchNorm with running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167; FedBN, arXiv:2102.07623, keeps it
local). Built by `fedprism.models._resnet.resnet_cifar` (decisions there)."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet_cifar
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet20", lambda shape, k: resnet_cifar(20, shape[0], k, "bn"),
    title="ResNet-20, CIFAR-10 network (He et al. 2016, arXiv:1512.03385), BatchNorm with running statistics",
    inputs="[C, H, W] images with H, W >= 4 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet20", 4), conv=False,
    body="conv3x3(16)-BN, 3 stages of 3 BasicBlocks x 16/32/64, avgpool", head="fc(classes)", shape=(3, 32, 32)))
