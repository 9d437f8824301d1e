"""The inference pooling (models/pooling.py): the same numbers as max_pool2d, used only without gradients."""

import torch
import torch.nn.functional as F

from fedprism.models import build_model
from fedprism.models.pooling import MaxPool2x2, for_inference
from fedprism.params import Functional, flatten


def test_maxpool2x2_is_max_pool2d_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 6, 28, 28), (2, 4, 9, 7), (5, 1, 2, 2), (4, 16, 10, 10)]:
        x = torch.randn(shape, generator=g)
        x[0, 0, 0, 0] = float("nan")
        x[-1, -1, -1, :] = float("-inf")
        a, b = MaxPool2x2()(x), F.max_pool2d(x, 2, 2)
        assert a.shape == b.shape
        assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
        assert torch.equal(a.isnan(), b.isnan())


def test_functional_uses_it_only_without_gradients():
    model = build_model("lenet5", (1, 32, 32), 10)
    f = Functional(model, for_inference(model))           # what the engine builds
    inf = f.inference_module
    assert inf is not None and sum(isinstance(m, MaxPool2x2) for m in inf.modules()) == 2
    assert not any(isinstance(m, MaxPool2x2) for m in model.modules())          # the model is untouched
    assert for_inference(build_model("mlp", (1, 8, 8), 10)) is None              # nothing to replace
    flat = flatten(model).detach()
    x = torch.randn(64, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    calls = []
    hook = inf.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        fast = f(flat, x)
    assert calls == [1]
    slow = f(flat.clone().requires_grad_(True), x)                               # gradients on: the model
    assert calls == [1]
    assert torch.equal(fast, slow.detach())
    with torch.inference_mode():
        fast_z = f.features(flat, x)
    assert calls == [1, 1]
    assert torch.equal(fast_z, f.features(flat.clone().requires_grad_(True), x).detach())
    hook.remove()
