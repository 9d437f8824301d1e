"""The sentence-classification CNN of Kim (`text_cnn`): "Convolutional Neural Networks for Sentence
Classification", Y. Kim, 2014, arXiv:1408.5882 (the CNN-rand variant: embeddings learned from scratch)."""

from __future__ import annotations

import torch
from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split
from fedprism.models.dropout import SeededDropout

#: filter widths and feature maps per width (the paper's 3, 4, 5 with 100 maps each), dropout rate (0.5)
WIDTHS, MAPS, DROPOUT = (3, 4, 5), 100, 0.5
#: embedding width. Decision where the paper is silent for CNN-rand: it uses 300 for its word2vec vectors;
#: learned from scratch on federated clients' small vocabularies, 128 keeps the same model shape at a
#: fraction of the embedding table (the table dominates the parameter count: vocab x width)
EMBED = 128


class _MaxOverTime(nn.Module):
    """conv(w) over the sequence for each width, ReLU, max over time, concatenated: [B, len(widths) x maps]."""

    def __init__(self, embed: int, widths: tuple[int, ...], maps: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(embed, maps, w) for w in widths)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        e = e.transpose(1, 2)                                   # [B, embed, seq_len]
        return torch.cat([torch.relu(c(e)).amax(dim=2) for c in self.convs], dim=1)


class _Embed(nn.Module):
    def __init__(self, vocab_size: int, width: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x)


class TextCNN(Split):
    """Kim (2014) CNN-rand: embedding -> conv(3, 4, 5 tokens; 100 maps each) -> ReLU -> max over time
    (the body: its 300 outputs are the penultimate features) -> dropout 0.5 -> fc(classes) (the head).

    Decisions where the paper is silent or that differ from it: embedding width 128 (`EMBED`); the
    paper's max-norm constraint on the classifier weights (l2 norm <= 3, re-projected after each step) is
    not applied, as the engines' one update rule (`engine.base.optimizer_step`) has no projection;
    dropout is `SeededDropout` (the same masks in both engines and on Flower nodes), applied to the
    penultimate features as in the paper, at the start of the head. Token 0 is an ordinary id (no padding
    index: a dataset pads with an id of its own vocabulary)."""

    def __init__(self, vocab_size: int, num_classes: int, embed: int = EMBED, widths: tuple[int, ...] = WIDTHS,
                 maps: int = MAPS, dropout: float = DROPOUT):
        super().__init__()
        self.body = nn.Sequential(_Embed(vocab_size, embed), _MaxOverTime(embed, widths, maps))
        self.head = nn.Sequential(SeededDropout(dropout), nn.Linear(len(widths) * maps, num_classes))


def refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 1 or shape[0] < max(WIDTHS):
        return (f"text_cnn needs token sequences [seq_len] of at least {max(WIDTHS)} tokens (its widest filter), "
                f"data has {list(shape)}")
    return None


SPEC = MODELS.register(ModelSpec(
    "text_cnn", lambda shape, k, vocab_size: TextCNN(vocab_size, k),
    title="sentence-classification CNN (Kim 2014, arXiv:1408.5882), CNN-rand; model=auto for token data",
    inputs="token sequences [seq_len], seq_len >= 5", refuse=refuse,
    body=f"embedding({EMBED})-conv(3/4/5 tokens, {MAPS} maps each)-max over time",
    head="dropout 0.5-fc(classes)", shape=(25,), conv=False, tokens=True, vocab=10000))
