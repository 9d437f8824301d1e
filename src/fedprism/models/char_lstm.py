"""The character LSTM of LEAF's Shakespeare benchmark (`char_lstm`): "LEAF: A Benchmark for Federated
Settings", S. Caldas et al., 2018, arXiv:1812.01097; the model of "Communication-Efficient Learning of
Deep Networks from Decentralized Data", H. B. McMahan et al., 2017, arXiv:1602.05629 (section 3)."""

from __future__ import annotations

import torch
from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split

#: LEAF's Shakespeare model: 8-dimensional character embedding, a 2-layer LSTM of 256 units
EMBED, HIDDEN, LAYERS = 8, 256, 2


class _LastOutput(nn.Module):
    """Embedding -> stacked LSTM over the sequence -> the top layer's output at the last position."""

    def __init__(self, vocab_size: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(x))
        return out[:, -1]


class CharLSTM(Split):
    """Next-character prediction: embedding(8) -> LSTM(256) -> LSTM(256), the last position's output (the
    body: 256 penultimate features) -> fc(classes) (the head), classes = the characters predicted (LEAF:
    the 80-character vocabulary, so classes = vocab_size there).

    As LEAF's reference model (`models/shakespeare/stacked_lstm.py`): one next character per sequence of
    80 characters, predicted from the top layer's output at the last step; PyTorch's default
    initialisation (uniform +-1/sqrt(256) for the LSTM) under the run seed. The LSTM is PyTorch's fused
    `nn.LSTM`, which `torch.func.vmap` cannot batch: `engine=auto` runs it on the sequential engine and
    `engine=vectorized` refuses it (`fedprism.engine.vectorized.unvmappable`)."""

    def __init__(self, vocab_size: int, num_classes: int, embed: int = EMBED, hidden: int = HIDDEN,
                 layers: int = LAYERS):
        super().__init__()
        self.body = _LastOutput(vocab_size, embed, hidden, layers)
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


def refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 1:
        return f"char_lstm needs token sequences [seq_len], data has {list(shape)}"
    return None


SPEC = MODELS.register(ModelSpec(
    "char_lstm", lambda shape, k, vocab_size: CharLSTM(vocab_size, k),
    title="character LSTM of LEAF's Shakespeare (Caldas et al. 2018, arXiv:1812.01097; McMahan et al. 2017, "
          "arXiv:1602.05629)",
    inputs="token sequences [seq_len] (LEAF: 80 characters)", refuse=refuse,
    body=f"embedding({EMBED})-LSTM({HIDDEN})x{LAYERS}-last step", head="fc(classes)", shape=(80,), conv=False,
    tokens=True, vocab=80))
