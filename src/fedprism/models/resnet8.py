"""ResNet-8 (`resnet8`), the smallest CIFAR-10 network of the family of He, Zhang, Ren, Sun 2016, "Deep Residual
Learning for Image Recognition", arXiv:1512.03385 (section 4.2, depth 6n + 2 with n = 1: 16/32/64 channels,
zero-padding shortcuts), with BatchNorm with running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167; FedBN,
arXiv:2102.07623, keeps it local). Built by `fedprism.models._resnet.resnet_cifar` (decisions there)."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet_cifar
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet8", lambda shape, k: resnet_cifar(8, shape[0], k, "bn"),
    title="ResNet-8, CIFAR-10 family (He et al. 2016, arXiv:1512.03385, n = 1), BatchNorm with running statistics",
    inputs="[C, H, W] images with H, W >= 4 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet8", 4), conv=False,
    body="conv3x3(16)-BN, 3 stages of 1 BasicBlock x 16/32/64, avgpool", head="fc(classes)", shape=(3, 32, 32)))
