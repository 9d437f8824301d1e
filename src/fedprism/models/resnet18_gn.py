"""ResNet-18 in its CIFAR form with GroupNorm (`resnet18_gn`): He, Zhang, Ren, Sun 2016, "Deep Residual
Learning for Image Recognition", arXiv:1512.03385, every BatchNorm replaced by GroupNorm with 2 groups (Wu & He
2018, "Group Normalization", arXiv:1803.08494; 2 groups as Reddi et al. 2021, "Adaptive Federated
Optimization", arXiv:2003.00295). Built by `fedprism.models._resnet.resnet18` (decisions there)."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet18
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet18_gn", lambda shape, k: resnet18(shape[0], k, "gn"),
    title="ResNet-18, CIFAR form (He et al. 2016, arXiv:1512.03385), GroupNorm with 2 groups (arXiv:1803.08494)",
    inputs="[C, H, W] images with H, W >= 8 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet18_gn", 8), conv=False,
    body="conv3x3(64)-GN, BasicBlocks [2,2,2,2] x 64/128/256/512, avgpool", head="fc(classes)", shape=(3, 32, 32)))
