"""Logistic regression (`logreg`): one fully connected layer, the ACSIncome model of Clust-PSI-PFL."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split, features


class LogReg(Split):
    """Multinomial logistic regression: the body only flattens (the penultimate features are the inputs
    themselves), the head is the one linear layer whose softmax is the model (Clust-PSI-PFL,
    Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, section IV-A: "a single fully connected layer with a
    softmax/sigmoid output (i.e., a logistic-regression baseline)"). Decision: two classes are two logits
    under softmax cross-entropy (equivalent to one sigmoid logit up to the parametrisation), so every method
    and metric treats it as any classifier."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten())
        self.head = nn.Sequential(nn.Linear(in_features, num_classes))


SPEC = MODELS.register(ModelSpec(
    "logreg", lambda shape, k: LogReg(features(shape), k),
    title="logistic regression, one fully connected layer (Clust-PSI-PFL's ACSIncome model, "
          "arXiv:2512.20363)",
    inputs="any shape (flattened)", body="flatten (no parameters)", head="fc(classes)", shape=(10,),
    conv=False))
