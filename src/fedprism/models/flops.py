"""Forward multiply-adds of a model, counted one way for every model (`fedprism models` lists them).

The counter is PyTorch's `torch.utils.flop_counter.FlopCounterMode`, which sees every aten operator a
forward pass runs and counts the matrix products and convolutions (`mm`, `addmm`, `bmm`, `convolution`,
attention) at 2 FLOPs per multiply-add; the count here is its total halved, i.e. **multiply-adds (MACs)**
of those operators. Added to its table: PyTorch's fused recurrent kernels (`aten::lstm`, `aten::gru`,
`aten::rnn_tanh`, `aten::rnn_relu`, and `aten::mkldnn_rnn_layer`, one LSTM layer as oneDNN runs it on
CPU), which it does not see into: per layer and time step, g gate blocks of H x (I + H) multiply-adds
(g = 4 for an LSTM, 3 for a GRU, 1 for a plain RNN), the products of the input and the hidden state with
the gate weights, as the unfused formula computes them.

Not counted (as in FlopCounterMode and the usual MAC tables): bias additions, activations, normalisation,
pooling, embedding look-ups (a gather, no arithmetic), and the element-wise gate arithmetic of recurrent
layers. The count is for one sample (a batch of one) in evaluation mode, so dropout and BatchNorm take their
inference paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["forward_macs"]

#: gate blocks per recurrent cell
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _rnn_formula(gates: int):
    """A FlopCounterMode formula (it passes shapes) for aten::<rnn>.input(input, hx, params, has_biases,
    num_layers, dropout, train, bidirectional, batch_first): FLOPs = 2 x MACs."""
    def formula(input_shape, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                *args: Any, out_shape=None, **kwargs: Any) -> int:
        h_shape = hx[0] if isinstance(hx, (list, tuple)) and isinstance(hx[0], (list, tuple, torch.Size)) else hx
        hidden = int(h_shape[-1])
        if len(input_shape) == 3:
            b, t = (input_shape[0], input_shape[1]) if batch_first else (input_shape[1], input_shape[0])
        else:                                                    # unbatched [T, I]
            b, t = 1, input_shape[0]
        dirs = 2 if bidirectional else 1
        size, macs = int(input_shape[-1]), 0
        for _ in range(int(num_layers)):
            macs += dirs * b * t * gates * hidden * (size + hidden)
            size = dirs * hidden
        return 2 * macs
    return formula


def _mkldnn_rnn_layer(input_shape, w_ih, w_hh, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """aten::mkldnn_rnn_layer (one layer and direction of an LSTM on CPU with oneDNN): input [T, B, I],
    weights [g H, I] and [g H, H]: T B (g H I + g H H) multiply-adds."""
    steps = int(input_shape[0]) * int(input_shape[1])
    return 2 * steps * (int(w_ih[0]) * int(w_ih[1]) + int(w_hh[0]) * int(w_hh[1]))


def _custom_mapping() -> dict:
    aten = torch.ops.aten
    out = {getattr(aten, name): _rnn_formula(g) for name, g in _GATES.items() if hasattr(aten, name)}
    if hasattr(aten, "mkldnn_rnn_layer"):
        out[aten.mkldnn_rnn_layer] = _mkldnn_rnn_layer
    return out


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
