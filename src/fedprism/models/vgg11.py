"""VGG-11 in its CIFAR form (`vgg11`): Simonyan & Zisserman, "Very Deep Convolutional Networks for
Large-Scale Image Recognition", 2014, arXiv:1409.1556 (configuration A, Table 1)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split
from fedprism.models.dropout import SeededDropout

#: configuration A: 3x3 convolutions (output channels) and 2x2 max-pooling ("M")
CONFIG_A = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
#: fully connected width: the paper's 4096 scaled to the CIFAR feature map (see `VGG11`)
FC = 512


class VGG11(Split):
    """VGG-11 (configuration A): eight 3x3 convolutions (stride 1, padding 1) with ReLU and five 2x2
    max-poolings, then fc512-ReLU-dropout 0.5-fc512-ReLU-dropout 0.5 (the body: 512 penultimate features) and
    fc(classes) (the head).

    The CIFAR form, decisions where the paper is silent or that differ from it:

    * **No normalisation layers**, as in the paper (BatchNorm came later: Ioffe & Szegedy 2015,
      arXiv:1502.03167). So every method averages the whole model exactly as it averages any other
      parameter vector; FedBN has nothing to keep local here (use `resnet18` or `lenet5_bn` for
      normalisation-aware methods).
    * **Classifier at 512 units** instead of 4096: a 32x32 image leaves a 1x1x512 map after the five
      poolings (ImageNet's 224x224 leaves 7x7x512), so the first fc layer has 49x fewer inputs; the paper's
      three fc layers with dropout 0.5 after the first two are kept. Larger inputs (H and W multiples of
      32, e.g. Tiny-ImageNet's 64x64) flatten a larger map into the first fc layer.
    * PyTorch's default initialisation under the run seed (the paper drew configuration A's weights from
      N(0, 0.01)); dropout is `SeededDropout` (the same masks in both engines and on Flower nodes).
    """

    def __init__(self, in_channels: int, num_classes: int, height: int = 32, width: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for v in CONFIG_A:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU()]
                c = int(v)
        flat = c * (height // 32) * (width // 32)
        self.body = nn.Sequential(*layers, nn.Flatten(),
                                  nn.Linear(flat, FC), nn.ReLU(), SeededDropout(0.5),
                                  nn.Linear(FC, FC), nn.ReLU(), SeededDropout(0.5))
        self.head = nn.Sequential(nn.Linear(FC, num_classes))


def refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 3 or shape[1] % 32 or shape[2] % 32 or not shape[1] or not shape[2]:
        return (f"vgg11 needs [C, H, W] images with H and W multiples of 32 (five 2x2 poolings; 28x28 ones are "
                f"padded with data.pad32), data has {list(shape)}")
    return None


SPEC = MODELS.register(ModelSpec(
    "vgg11", lambda shape, k: VGG11(shape[0], k, shape[1], shape[2]),
    title="VGG-11 (Simonyan & Zisserman 2014, arXiv:1409.1556), configuration A in its CIFAR form, no BatchNorm",
    inputs="[C, H, W] images, H and W multiples of 32 (28x28 ones padded: data.pad32=auto)", refuse=refuse,
    pad32=True, conv=False,
    body="8 x conv3x3 (64-128-256x2-512x4), 5 max-pools, fc512-dropout-fc512-dropout", head="fc(classes)",
    shape=(3, 32, 32)))
