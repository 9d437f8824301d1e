"""Forward multiply-adds of a model, counted one way for every model (`fedprism models` lists them).

The counter is PyTorch's `torch.utils.flop_counter.FlopCounterMode`, which sees every aten operator a
forward pass runs and counts the matrix products and convolutions (`mm`, `addmm`, `bmm`, `convolution`,
attention) at 2 FLOPs per multiply-add; the count here is its total halved, i.e. **multiply-adds (MACs)**
of those operators. Recurrent layers reach the counter as the operators they are lowered to: `nn.GRU`
and `nn.RNN` as matrix products it counts, `nn.LSTM` on CPU as oneDNN's fused `aten::mkldnn_rnn_layer`
(one layer and direction), which it does not see into and which is added to its table here: T x B x
(g H x I + g H x H) multiply-adds for T steps of B sequences (g = 4 gate blocks of H units, input width
I), the products of the input and of the hidden state with the gate weights, as the unfused formula
computes them.

Not counted (as in FlopCounterMode and the usual MAC tables): bias additions, activations, normalisation,
pooling, embedding look-ups (a gather, no arithmetic), and the element-wise gate arithmetic of recurrent
layers. The count is for one sample (a batch of one) in evaluation mode, so dropout and BatchNorm take their
inference paths and running statistics stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["forward_macs"]


def _mkldnn_rnn_layer(input_shape, w_ih, w_hh, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """aten::mkldnn_rnn_layer (one layer and direction of an LSTM on CPU with oneDNN): input [T, B, I],
    weights [g H, I] and [g H, H]: T B (g H I + g H H) multiply-adds."""
    steps = int(input_shape[0]) * int(input_shape[1])
    return 2 * steps * (int(w_ih[0]) * int(w_ih[1]) + int(w_hh[0]) * int(w_hh[1]))


def _custom_mapping() -> dict:
    aten = torch.ops.aten
    return {aten.mkldnn_rnn_layer: _mkldnn_rnn_layer} if hasattr(aten, "mkldnn_rnn_layer") else {}


def forward_macs(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Multiply-adds of one forward pass of `model` on one sample of `input_shape` (int64 zeros, token 0,
    for a token model: `dtype`), counted as the module docstring says. The model is put in evaluation mode
    for the count and back in the mode it was in."""
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    model.eval()
    try:
        x = torch.zeros((1, *input_shape), dtype=dtype)
        with FlopCounterMode(display=False, custom_mapping=_custom_mapping()) as counter, torch.no_grad():
            model(x)
    finally:
        model.train(was)
    return int(counter.get_total_flops()) // 2
