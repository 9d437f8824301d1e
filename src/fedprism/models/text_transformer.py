"""A small transformer encoder for sentence classification (`text_transformer`): the encoder of Vaswani et al.,
"Attention Is All You Need", 2017, arXiv:1706.03762, with layer normalisation before each sub-layer (Xiong et
al., "On Layer Normalization in the Transformer Architecture", 2020, arXiv:2002.04745)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split
from fedprism.models.dropout import SeededDropout

#: model width, attention heads, feed-forward width, encoder layers, dropout on each residual branch
WIDTH, HEADS, FFN, LAYERS, DROPOUT = 64, 4, 128, 2, 0.1


class _Attention(nn.Module):
    """Multi-head self-attention written out (one Linear for q, k, v; softmax(q k^T / sqrt(d_head)) v; one
    Linear out): plain matrix products, so `torch.func.vmap` batches it (PyTorch's `nn.MultiheadAttention`
    has fused fast paths) and the FLOP counter sees every product."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class _Layer(nn.Module):
    """x + drop(attention(LN(x))), then x + drop(FFN(LN(x))), FFN = fc-GELU-fc (pre-LN)."""

    def __init__(self, width: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.ln1, self.attn, self.drop1 = nn.LayerNorm(width), _Attention(width, heads), SeededDropout(dropout)
        self.ln2 = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn), nn.GELU(), nn.Linear(ffn, width))
        self.drop2 = SeededDropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.ffn(self.ln2(x)))


class _Encoder(nn.Module):
    """Token and learned position embeddings, the encoder layers, a final LayerNorm, mean over positions."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, heads: int, ffn: int, layers: int,
                 dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.layers = nn.Sequential(*(_Layer(width, heads, ffn, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.embedding(x) + self.position)).mean(dim=1)


class TextTransformer(Split):
    """Token embedding (64) + learned positions -> 2 pre-LN encoder layers (4 heads, feed-forward 128,
    GELU, dropout 0.1 on each residual branch) -> LayerNorm -> mean over positions (the body: 64
    penultimate features) -> fc(classes) (the head).

    Decisions where the paper is silent or that differ from it, for a model small enough for federated
    clients: a few layers of width 64 (the paper's base model: 6 layers of 512); learned position embeddings
    (N(0, 0.02)) instead of sinusoids; pre-LN (Xiong et al. 2020), which trains without the paper's learning
    rate warm-up; mean pooling over all positions (padding included: a dataset's padding id is an ordinary
    token, as in `text_cnn`); attention written out with matrix products (`_Attention`); dropout is
    `SeededDropout` (the same masks in both engines and on Flower nodes)."""

    def __init__(self, vocab_size: int, seq_len: int, num_classes: int, width: int = WIDTH, heads: int = HEADS,
                 ffn: int = FFN, layers: int = LAYERS, dropout: float = DROPOUT):
        super().__init__()
        self.body = _Encoder(vocab_size, seq_len, width, heads, ffn, layers, dropout)
        self.head = nn.Sequential(nn.Linear(width, num_classes))


def refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 1:
        return f"text_transformer needs token sequences [seq_len], data has {list(shape)}"
    return None


SPEC = MODELS.register(ModelSpec(
    "text_transformer", lambda shape, k, vocab_size: TextTransformer(vocab_size, shape[0], k),
    title="a small pre-LN transformer encoder for sentence classification (Vaswani et al. 2017, "
          "arXiv:1706.03762; Xiong et al. 2020, arXiv:2002.04745)",
    inputs="token sequences [seq_len] (position embeddings sized to it)", refuse=refuse,
    body=f"embedding({WIDTH})+positions, {LAYERS} x pre-LN encoder layer ({HEADS} heads, FFN {FFN}), LN, mean",
    head="fc(classes)", shape=(25,), conv=False, tokens=True, vocab=10000))
