"""LeNet-300-100 (LeCun, Bottou, Bengio, Haffner 1998, "Gradient-based learning applied to document
recognition", Proc. IEEE 86(11)) as an external model plugin.

The worked example of docs/adding-a-model.md: a package registers it through the `fedprism.models`
entry-point group and it runs through `fedprism run`, sweeps, reports and Flower like a built-in model,
with a body/head split that head-sharing and prototype methods use.
"""

from torch import nn

from fedprism.models import ModelSpec, Split

MAX_INPUTS = 3 * 32 * 32


class LeNet300(Split):
    """fc300-ReLU-fc100-ReLU (the body: its 100 outputs are the penultimate features), fc(classes) (the
    head). PyTorch's default initialisation, drawn under the run seed."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 300), nn.ReLU(),
                                  nn.Linear(300, 100), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(100, num_classes))


def inputs(input_shape: tuple[int, ...]) -> int:
    n = 1
    for d in input_shape:
        n *= d
    return n


def build(input_shape: tuple[int, ...], num_classes: int) -> LeNet300:
    return LeNet300(inputs(input_shape), num_classes)


def refuse(input_shape: tuple[int, ...]) -> str | None:
    if inputs(input_shape) > MAX_INPUTS:
        return (f"lenet300 takes at most {MAX_INPUTS} inputs once flattened (a 32x32 colour image), data has "
                f"{list(input_shape)}")
    return None


SPEC = ModelSpec(
    name="lenet300",
    build=build,
    title="LeNet-300-100 (LeCun et al. 1998), a fully connected network",
    inputs=f"any shape, at most {MAX_INPUTS} values once flattened",
    refuse=refuse,
    body="flatten-fc300-fc100",
    head="fc(classes)",
    shape=(1, 28, 28),
)
