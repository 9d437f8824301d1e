"""The CIFAR-10 CNN of Clust-PSI-PFL (`clustpsi_cifar_cnn`; Jimenez-Gutierrez et al. 2025,
arXiv:2512.20363)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import BATCH_STATS, MODELS, BatchNorm1d, ModelSpec, Split
from fedprism.models.dropout import SeededDropout


class PsiCifarCNN(Split):
    """The CIFAR-10 CNN of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, section IV-A)
    (`clustpsi_cifar_cnn`): "three feature-extraction blocks. In each block, two 3x3 convolutions (ReLU,
    same padding) are applied and regularized with batch normalization, after which a 2x2 max-pooling
    ... dropout after each block, increasing the rate from 0.2 to 0.3 and 0.4 ... 32, 64, and 128
    filters ... a 128-unit fully connected ReLU layer with batch normalization and dropout (p=0.5), and a
    softmax output over the C classes":

        block(f, p) = conv3x3(f, same) - ReLU - BN - conv3x3(f, same) - ReLU - BN - maxpool 2x2 - dropout(p)
        body = block(32, 0.2) - block(64, 0.3) - block(128, 0.4) - flatten - fc128 - ReLU - BN
        head = dropout(0.5) - fc(classes)          (softmax in the loss)

    Where the paper is silent: ReLU before BatchNorm (the order in which it names them; a convolution
    with a ReLU activation followed by a BatchNorm layer), the last dropout at the start of the head
    (the same function as at the end of the body; this way the penultimate features that prototype
    methods use carry no dropout noise), BatchNorm on batch statistics like every BatchNorm here
    (`fedprism.params`), inputs of any size whose sides are multiples of 8 (32x32: 128 x 4 x 4 = 2048
    features into fc128; about 0.55 M parameters). Dropout is `SeededDropout`: the masks of a local step
    are fixed by (run seed, round, client, stream, step), the same in both engines and on Flower nodes,
    and evaluation runs without dropout.
    """

    RATES = (0.2, 0.3, 0.4)
    HEAD_RATE = 0.5

    def __init__(self, in_channels: int, size: tuple[int, int], num_classes: int = 10,
                 rates: tuple[float, float, float] = RATES, head_rate: float = HEAD_RATE):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for f, p in zip((32, 64, 128), rates):
            layers += [nn.Conv2d(c, f, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(f, **BATCH_STATS),
                       nn.Conv2d(f, f, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(f, **BATCH_STATS),
                       nn.MaxPool2d(2), SeededDropout(p)]
            c = f
        h, w = size[0] // 8, size[1] // 8
        layers += [nn.Flatten(), nn.Linear(128 * h * w, 128), nn.ReLU(), BatchNorm1d(128)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(SeededDropout(head_rate), nn.Linear(128, num_classes))


def _refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 3 or shape[1] % 8 or shape[2] % 8 or min(shape[1:]) < 8:
        return ("clustpsi_cifar_cnn needs [C, H, W] images with H and W multiples of 8 (three 2x2 poolings), "
                f"data has {list(shape)}")
    return None


SPEC = MODELS.register(ModelSpec(
    "clustpsi_cifar_cnn", lambda shape, k: PsiCifarCNN(shape[0], tuple(shape[1:]), k),
    title="the CIFAR-10 CNN of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, IV-A)",
    inputs="[C, H, W] images, H and W multiples of 8 (28x28 ones padded to 32x32: data.pad32=auto)",
    refuse=_refuse, pad32=True,
    body="3 x (2 x conv3x3-ReLU-BN, pool, dropout 0.2/0.3/0.4)-fc128-ReLU-BN", head="dropout(0.5)-fc(classes)",
    shape=(3, 32, 32)))
