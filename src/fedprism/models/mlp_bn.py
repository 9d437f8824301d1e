"""The MLP with BatchNorm after each hidden layer (`mlp_bn`)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, BatchNorm1d, ModelSpec, Split, features


class MLPBN(Split):
    """`MLP` with BatchNorm after each hidden linear layer (linear-BN-ReLU); same initial linear layers
    as `MLP` for the same seed."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(),
                                  nn.Linear(in_features, hidden), BatchNorm1d(hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


SPEC = MODELS.register(ModelSpec(
    "mlp_bn", lambda shape, k: MLPBN(features(shape), k),
    title="`mlp` with BatchNorm after each hidden layer (batch statistics)",
    inputs="any shape (flattened)", body="flatten-fc64-BN-fc64-BN", head="fc(classes)", shape=(1, 8, 8), conv=False))
