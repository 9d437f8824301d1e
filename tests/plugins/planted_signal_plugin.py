"""A planted test-only signal for `fedprism tune` (tests/test_tune.py).

`planted`: three well-separated Gaussian classes whose test labels are shifted by one class, y_test =
(y + 1) mod 3, while the training rows (and so the validation rows carved from them) keep their labels.
`shifted_fedavg`: FedAvg whose clients predict with their logits rolled by `shift` classes. shift = 0 is
right on the validation splits and wrong on the test splits; shift = 1 the reverse. A tuner that read a
test metric would choose shift = 1; one that reads validation metrics only chooses shift = 0.

The method declares its search space beside its parameter (`Param(..., space=Space(...))`), as a method
written today does.
"""

import numpy as np
import torch

from fedprism.algorithms.base import Inference
from fedprism.algorithms.fedavg import FedAvg
from fedprism.data.base import Dataset, DatasetSpec
from fedprism.hparams import Param, Space

CLASSES = ("a", "b", "c")
FEATURES = 4


def load(pad32: bool = False, root: str | None = None) -> Dataset:
    rng = np.random.default_rng(0)
    out = {}
    for split, n in (("train", 600), ("test", 300)):
        y = rng.integers(0, 3, n)
        x = rng.normal(0.0, 0.5, (n, FEATURES)).astype(np.float32)
        x[:, 0] += 3.0 * y
        x[:, 1] -= 3.0 * y
        out[split] = (torch.from_numpy(x), torch.from_numpy((y + (split == "test")) % 3).long())
    return Dataset(name="planted", x_train=out["train"][0], y_train=out["train"][1], x_test=out["test"][0],
                   y_test=out["test"][1], classes=list(CLASSES), source="planted")


SPEC = DatasetSpec(name="planted", load=load, summary="three Gaussian classes; test labels shifted by one class",
                   class_names=CLASSES, input_shape=(FEATURES,), normalisation="none (generated at unit scale)")


class ShiftedFedAvg(FedAvg):
    """FedAvg predicting with logits rolled by `shift` classes (the planted signal's method)."""

    name = "shifted_fedavg"
    personalized = False
    params = {**FedAvg.params,
              "shift": Param(0, "classes the logits are rolled by at prediction", choices=(0, 1),
                             space=Space(choices=(0, 1)))}

    def inference(self, trainer, clients, payload, cstate):
        shift = self.hp["shift"]
        return Inference({"model": payload["params"]},
                         combine=lambda logits, extras: torch.roll(logits["model"], shift, dims=-1))
