"""ResNet-20 with GroupNorm (`resnet20_gn`): the CIFAR-10 network of He, Zhang, Ren, Sun 2016, "Deep Residual
Learning for Image Recognition", arXiv:1512.03385 (section 4.2, n = 3), every BatchNorm replaced by GroupNorm
with 2 groups (Wu & He 2018, "Group Normalization", arXiv:1803.08494; 2 groups as Reddi et al. 2021, "Adaptive
Federated Optimization", arXiv:2003.00295). Built by `fedprism.models._resnet.resnet_cifar`."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet_cifar
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet20_gn", lambda shape, k: resnet_cifar(20, shape[0], k, "gn"),
    title="ResNet-20, CIFAR-10 network (He et al. 2016, arXiv:1512.03385), GroupNorm with 2 groups (arXiv:1803.08494)",
    inputs="[C, H, W] images with H, W >= 4 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet20_gn", 4), conv=False,
    body="conv3x3(16)-GN, 3 stages of 3 BasicBlocks x 16/32/64, avgpool", head="fc(classes)", shape=(3, 32, 32)))
