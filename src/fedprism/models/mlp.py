"""A two-hidden-layer perceptron (`mlp`) for tabular and 8x8 digits data."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split, features


class MLP(Split):
    """Two-hidden-layer perceptron for tabular and 8x8 digits data (inputs flattened)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


SPEC = MODELS.register(ModelSpec(
    "mlp", lambda shape, k: MLP(features(shape), k),
    title="two-hidden-layer perceptron, 64 units each (model=auto for data that is not images of 28px+)",
    inputs="any shape (flattened)", body="flatten-fc64-fc64", head="fc(classes)", shape=(1, 8, 8), conv=False))
