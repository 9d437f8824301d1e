"""ResNet-18 in its CIFAR form with BatchNorm (running statistics) (`resnet18`): He, Zhang, Ren, Sun 2016,
"Deep Residual Learning for Image Recognition", arXiv:1512.03385 (Table 1), with a 3x3 stem at stride 1 and no
max-pooling; BatchNorm with running statistics (Ioffe & Szegedy 2015, arXiv:1502.03167), which FedBN (Li et al.
2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", arXiv:2102.07623) keeps
local. Built by `fedprism.models._resnet.resnet18` (decisions there)."""

from __future__ import annotations

from fedprism.models._resnet import refuse_small, resnet18
from fedprism.models.base import MODELS, ModelSpec

SPEC = MODELS.register(ModelSpec(
    "resnet18", lambda shape, k: resnet18(shape[0], k, "bn"),
    title="ResNet-18, CIFAR form (He et al. 2016, arXiv:1512.03385), BatchNorm with running statistics",
    inputs="[C, H, W] images with H, W >= 8 (CIFAR's 32x32; global average pooling takes other sizes)",
    refuse=refuse_small("resnet18", 8), conv=False,
    body="conv3x3(64)-BN, BasicBlocks [2,2,2,2] x 64/128/256/512, avgpool", head="fc(classes)", shape=(3, 32, 32)))
