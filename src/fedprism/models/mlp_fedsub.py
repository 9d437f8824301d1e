"""The FedSub paper's perceptron (`mlp_fedsub`)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split, features


class MLPFedSub(Split):
    """The FedSub paper's network (Campana and Delmastro, Section 4.3): input-128-512-classes, ReLU.
    Its body is the two hidden layers (the penultimate features are the 512 activations), its head the
    output layer."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 128), nn.ReLU(),
                                  nn.Linear(128, 512), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(512, num_classes))


SPEC = MODELS.register(ModelSpec(
    "mlp_fedsub", lambda shape, k: MLPFedSub(features(shape), k),
    title="FedSub's perceptron, input-128-512-classes (Campana and Delmastro, section 4.3)",
    inputs="any shape (flattened)", body="flatten-fc128-fc512", head="fc(classes)", shape=(1, 28, 28), conv=False))
