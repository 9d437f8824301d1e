"""An MLP for tabular features (`tabular_mlp`): wider than `mlp`, with dropout, for rows of numeric
features such as ACSIncome's (Ding, Hardt, Miller, Schmidt 2021, "Retiring Adult: New Datasets for Fair
Machine Learning", arXiv:2108.04884)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split
from fedprism.models.dropout import SeededDropout

#: hidden widths and the dropout rate after each hidden layer
HIDDEN, DROPOUT = (256, 128), 0.2


class TabularMLP(Split):
    """fc256-ReLU-dropout 0.2-fc128-ReLU-dropout 0.2 (the body: 128 penultimate features), fc(classes) (the
    head), on rows of D features (`[D]` inputs only: images and sequences are refused, not flattened).

    No published architecture: the multilayer perceptron of tabular-data baselines (two hidden layers,
    a funnel of widths, dropout against the overfitting that small per-client tables invite). It differs
    from `mlp` (two hidden layers of 64, no dropout, any input flattened, the model=auto choice for small
    inputs, kept as it is for the stored runs) in width, regularisation and the inputs it takes. Dropout is
    `SeededDropout` (the same masks in both engines and on Flower nodes); PyTorch's default initialisation
    under the run seed. The features are expected standardised (a dataset that standardises at load time,
    as `acsincome` does)."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...] = HIDDEN,
                 dropout: float = DROPOUT):
        super().__init__()
        layers: list[nn.Module] = []
        d = in_features
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), SeededDropout(dropout)]
            d = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(d, num_classes))


def refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 1:
        return (f"tabular_mlp needs rows of features [D] (tabular data); data has {list(shape)} (model=mlp "
                "flattens any input)")
    return None


SPEC = MODELS.register(ModelSpec(
    "tabular_mlp", lambda shape, k: TabularMLP(shape[0], k),
    title="an MLP for tabular features: fc256-fc128 with dropout 0.2 (no published architecture)",
    inputs="rows of features [D]", refuse=refuse, conv=False,
    body="fc256-ReLU-dropout 0.2-fc128-ReLU-dropout 0.2", head="fc(classes)", shape=(10,)))
