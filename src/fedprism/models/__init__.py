"""Small networks with a body/head split (FedPrism paper 4.3; the Clust-PSI-PFL FMNIST and CIFAR-10 CNNs).

One module per model, each declaring a `ModelSpec` on the `MODELS` registry (`fedprism.models.base`
says what a spec declares): `lenet5`, `lenet5_bn`, `mlp`, `mlp_bn`, `mlp_fedsub`, `cnn`,
`clustpsi_fmnist_cnn`, `clustpsi_cifar_cnn`, `vgg11`, `tabular_mlp`, the CIFAR ResNets `resnet18`, `resnet20`,
`resnet8` (BatchNorm with running statistics; `_gn`: GroupNorm) and `mobilenet_small` (built by `_resnet`),
and the token models (text:
`ModelSpec.tokens`) `char_lstm`, `text_cnn`, `text_transformer`, among others. Nothing here imports them:
`build_model(name, ...)` imports the one it builds. Shared layers live in `base` (`Split`, `BatchNorm1d`, `RunningBatchNorm1d/2d`),
`dropout` (`SeededDropout`) and `pooling`. `fedprism models` lists every registered model with its input
constraints, its parameter count, its forward multiply-adds (`flops`) and its body/head split.
"""

from __future__ import annotations

from typing import Any

from fedprism.models.base import (MODELS, BatchNorm1d, ModelSpec, RunningBatchNorm1d, RunningBatchNorm2d, Split,
                                  build_model)

_Split = Split                  # the name the model classes had before each got its own module

#: class -> the module (= model name) that defines it, imported when the class is asked for
_CLASSES = {"LeNet5": "lenet5", "LeNet5BN": "lenet5_bn", "MLP": "mlp", "MLPBN": "mlp_bn",
            "MLPFedSub": "mlp_fedsub", "SmallCNN": "cnn", "PsiFmnistCNN": "clustpsi_fmnist_cnn",
            "PsiCifarCNN": "clustpsi_cifar_cnn"}

#: the model `model=auto` chooses for images of at least 28 pixels, for other float inputs, and for token
#: data (`experiment.federation.resolve_model_name`)
AUTO_IMAGES, AUTO_OTHER, AUTO_TOKENS = "lenet5", "mlp", "text_cnn"


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MODELS", "ModelSpec", "Split", "BatchNorm1d", "RunningBatchNorm1d", "RunningBatchNorm2d", "build_model", "AUTO_IMAGES", "AUTO_OTHER",
           "AUTO_TOKENS", *_CLASSES]
