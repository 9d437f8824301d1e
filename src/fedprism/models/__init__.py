"""Small networks with a body/head split (FedPrism paper 4.3; the Clust-PSI-PFL FMNIST and CIFAR-10 CNNs).

Every model is `head(body(x))`: `body` ends with the penultimate features, `head` holds the
classifier. Prototype and head-only methods use `ParamSpec.head` / `.body` slices, never layer names;
methods that keep normalisation layers apart use `ParamSpec.batchnorm`. `forward(x, features_only=True)`
returns the body output. `lenet5_bn` and `mlp_bn` are LeNet-5 and the MLP with BatchNorm after each
convolution / hidden linear layer (batch statistics, see `fedprism.params` and docs/architecture.md).
Dropout is `fedprism.models.dropout.SeededDropout` (masks from a key the engines derive per run seed,
round, client and step; identity at evaluation), never `torch.nn.Dropout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedprism.errors import ConfigError
from fedprism.models.dropout import SeededDropout


class _Split(nn.Module):
    body: nn.Module
    head: nn.Module

    def forward(self, x: torch.Tensor, features_only: bool = False) -> torch.Tensor:
        z = self.body(x)
        return z if features_only else self.head(z)


class LeNet5(_Split):
    """LeNet-5 as in the FedPrism paper 4.3: conv(6,5x5)-pool-conv(16,5x5)-pool-fc120-fc84-fc(classes).

    Inputs are 32x32 with 1 (FMNIST padded from 28x28) or 3 channels. ReLU and max-pooling, the
    common modern reading of the paper's "LeNet-5".
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(84, num_classes))


class MLP(_Split):
    """Two-hidden-layer perceptron for tabular and 8x8 digits data (inputs flattened)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


class MLPFedSub(_Split):
    """The FedSub paper's network (Campana and Delmastro, Section 4.3): input-128-512-classes, ReLU.
    Its body is the two hidden layers (the penultimate features are the 512 activations), its head the
    output layer."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 128), nn.ReLU(),
                                  nn.Linear(128, 512), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(512, num_classes))


class SmallCNN(_Split):
    """A small CNN for 32x32 inputs (`cnn`): two conv(3x3)-BN-ReLU-pool blocks, fc256, fc(classes); no
    published architecture. It is not the CIFAR-10 network of Clust-PSI-PFL (that one is
    `clustpsi_cifar_cnn`, `PsiCifarCNN`).

    BatchNorm uses batch statistics only (`track_running_stats=False`): no buffers, so the flat vector
    holds everything that is averaged (see `fedprism.params`).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.BatchNorm2d(32, track_running_stats=False),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64, track_running_stats=False),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(256, num_classes))


class PsiCifarCNN(_Split):
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
            layers += [nn.Conv2d(c, f, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(f, **_BATCH_STATS),
                       nn.Conv2d(f, f, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(f, **_BATCH_STATS),
                       nn.MaxPool2d(2), SeededDropout(p)]
            c = f
        h, w = size[0] // 8, size[1] // 8
        layers += [nn.Flatten(), nn.Linear(128 * h * w, 128), nn.ReLU(), BatchNorm1d(128)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(SeededDropout(head_rate), nn.Linear(128, num_classes))


class PsiFmnistCNN(_Split):
    """The FMNIST CNN of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, section IV-A):
    "three convolutional stages with 8, 16, and 32 feature maps ... followed by max-pooling and a dense
    layer with 2048 ReLU units before the final classifier" (`clustpsi_fmnist_cnn`).

    Where the paper is silent: 3x3 kernels with no padding (the paper names "same" padding for its CIFAR
    network only), ReLU after each convolution, one 2x2 max-pooling after the stack (as written), inputs
    at their own size (28x28 FMNIST: 22x22x32 -> 11x11x32 -> 2048; about 8 M parameters).
    """

    def __init__(self, in_channels: int, size: tuple[int, int], num_classes: int = 10):
        super().__init__()
        h, w = size[0] - 6, size[1] - 6
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
            nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (h // 2) * (w // 2), 2048), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(2048, num_classes))


_BATCH_STATS = {"track_running_stats": False}


class BatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d on batch statistics (no running statistics, as every BatchNorm here) that also takes a
    batch of one sample. Training keeps the last, partial batch (`engine.base.batch_order`), which holds
    a single sample whenever n_k = 1 mod B; torch's `F.batch_norm` refuses such a batch, while the
    formula is defined: the sample is its own batch mean, x_hat = 0, and the layer outputs its bias beta
    (exactly: computing x - mean in floating point would leave a rounding residue that 1/sqrt(eps)
    amplifies into noise, different from engine to engine)."""

    def __init__(self, num_features: int):
        super().__init__(num_features, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return x * 0 + self.bias
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


class LeNet5BN(_Split):
    """LeNet-5 with BatchNorm after each convolution and each hidden linear layer of the body (the layout of
    FedBN's digits model, Li et al. 2021, arXiv:2102.07623: conv-BN-ReLU-pool, fc-BN-ReLU); the head is
    LeNet-5's classifier. With the same seed its conv and linear layers start as `LeNet5`'s (BatchNorm
    starts at weight 1, bias 0 and draws no random numbers)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.BatchNorm2d(6, **_BATCH_STATS), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16, **_BATCH_STATS), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), BatchNorm1d(120), nn.ReLU(),
            nn.Linear(120, 84), BatchNorm1d(84), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(84, num_classes))


class MLPBN(_Split):
    """`MLP` with BatchNorm after each hidden linear layer (linear-BN-ReLU); same initial linear layers
    as `MLP` for the same seed."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(),
                                  nn.Linear(in_features, hidden), BatchNorm1d(hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


MODELS = ("lenet5", "mlp", "cnn", "lenet5_bn", "mlp_bn", "clustpsi_fmnist_cnn", "clustpsi_cifar_cnn", "mlp_fedsub")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """Instantiate a model with deterministic initial weights for `seed` (built-in or registered,
    `fedprism.plugins.MODELS`)."""
    from fedprism import plugins

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in plugins.MODELS and name not in MODELS:
            return plugins.MODELS[name](tuple(input_shape), num_classes)
        if name in ("lenet5", "lenet5_bn"):
            if len(input_shape) != 3 or input_shape[1:] != (32, 32):
                raise ConfigError("model", name, f"{name} needs [C, 32, 32] inputs, data has "
                                  f"{list(input_shape)}"
                                  " (set data.pad32=true for 28x28 images)")
            return (LeNet5 if name == "lenet5" else LeNet5BN)(input_shape[0], num_classes)
        if name in ("mlp", "mlp_bn", "mlp_fedsub"):
            feat = 1
            for d in input_shape:
                feat *= d
            if name == "mlp_fedsub":
                return MLPFedSub(feat, num_classes)
            return (MLP if name == "mlp" else MLPBN)(feat, num_classes)
        if name == "cnn":
            if len(input_shape) != 3 or input_shape[1:] != (32, 32):
                raise ConfigError("model", name, f"cnn needs [C, 32, 32] inputs, data has {list(input_shape)}")
            return SmallCNN(input_shape[0], num_classes)
        if name == "clustpsi_fmnist_cnn":
            if len(input_shape) != 3 or min(input_shape[1:]) < 8:
                raise ConfigError("model", name, f"{name} needs [C, H, W] images of at least 8x8, data has "
                                  f"{list(input_shape)}")
            return PsiFmnistCNN(input_shape[0], tuple(input_shape[1:]), num_classes)
        if name == "clustpsi_cifar_cnn":
            if len(input_shape) != 3 or input_shape[1] % 8 or input_shape[2] % 8 or min(input_shape[1:]) < 8:
                raise ConfigError("model", name, f"{name} needs [C, H, W] images with H and W multiples of 8 "
                                  f"(three 2x2 poolings), data has {list(input_shape)}")
            return PsiCifarCNN(input_shape[0], tuple(input_shape[1:]), num_classes)
    raise ConfigError("model", name, f"one of {', '.join(MODELS)}")
