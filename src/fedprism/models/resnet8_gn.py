"""ResNet-8 with GroupNorm (`resnet8_gn`): the CIFAR-10 family of He, Zhang, Ren, Sun 2016, "Deep Residual
Learning for Image Recognition", arXiv:1512.03385 (section 4.2, n = 1), every BatchNorm replaced by GroupNorm with
2 groups (Wu & He 2018, "Group Normalization", arXiv:1803.08494; 2 groups as Reddi et al. 2021, "Adaptive
Federated Optimization", arXiv:2003.00295). Built by `fedprism.models._resnet.resnet_cifar`."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet_cifar
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet8_gn", lambda shape, k: resnet_cifar(8, shape[0], k, "gn"),
    title="ResNet-8, CIFAR-10 family (He et al. 2016, arXiv:1512.03385, n = 1), GroupNorm with 2 groups (arXiv:1803.08494)",
    inputs="[C, H, W] images with H, W >= 4 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet8_gn", 4), conv=False,
    body="conv3x3(16)-GN, 3 stages of 1 BasicBlock x 16/32/64, avgpool", head="fc(classes)", shape=(3, 32, 32)))
