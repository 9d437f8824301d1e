"""Fused CPU kernels for ``Conv2d -> ReLU -> MaxPool2d(2)`` blocks: every such block in evaluation
(``eval.kernels = fused``), a model's first block and the one after it in local training
(``train.kernels = fused``, :class:`StemSplit`).

Why: on the FedPrism paper workload LeNet-5's two convolutions (1 -> 6 and 6 -> 16 channels, 5 x 5) and the
passes over their outputs are most of a CPU round (bench/README.md, "round_profile",
`bench/fused_stem.py`). `csrc/fused_stem.cpp` computes each pooled output in registers: the conv outputs
at the four corners of each 2 x 2 window, their maximum, then ReLU; the conv map is never written. It has
two layouts of the same sums. With at most three input channels (a first layer) a vector holds VL pooled
positions of one filter, read straight from the image's four polyphase planes (x[2i + a, 2j + b]), six
filters at a time. With more (an inner layer) a vector holds VL filters at one position, multiplied by a
broadcast input value, seven windows at a time. VL and those blockings are AVX-512's (16 floats, 32
registers); a build for a CPU without AVX-512 uses 8 floats and blocks of three, which fit AVX2's 16
registers (the AVX-512 blocking spilled there and ran 2-4x slower than PyTorch's layers;
`vector_floats()` says which build is loaded). The training forward also keeps each window's winning
corner, from which the backward forms the filters' and biases' gradients and, for an inner block, its
input's gradient; only winning corners have a gradient, so that backward runs over them alone.

Numbers: each output is the same sum of the same products as the convolution's, but summed in tap
order, so the logits differ from PyTorch's at float32 rounding (a few 1e-6) and a prediction can flip
where two classes tie to that precision; gradients likewise. So both are settings, `aten` by default
(every stored run's numbers), like `eval.precision`.

Where it applies: a plain ``Conv2d`` (stride 1, no padding, no dilation, one group, with bias, square
kernel) directly followed by ``ReLU`` and a plain 2 x 2 max-pooling inside an ``nn.Sequential``, on a CPU,
in float32 (a bfloat16 evaluation, or a CUDA device, runs the plain layers). Training fuses the model's
first block (whose input needs no gradient) and the next block where it qualifies. ``torch.vmap`` over
models maps onto the kernel's groups: a shared input batch stacks all models' filters into one group, a
batch per model gives one group per model (read in place from the previous block's output: no copy).

Evaluation by minimal filtering, F(2 x 2, 5 x 5) (Lavin & Gray, "Fast Algorithms for Convolutional Neural
Networks", CVPR 2016, arXiv:1509.09308), was measured here as `eval.kernels = winograd` and removed: it
saved less than 10 % of the paper workload's end-to-end time against these kernels (bench/README.md,
"The default path: `auto` kernels").

The libraries are built, cached and loaded by `fedprism.kernels.build` (each on its own: a library that
cannot be built leaves the other usable); which kernels a run uses is resolved before its run id is computed
(`fedprism.kernels.resolve`), so a run that asked for them where they cannot run is stored as what ran.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedprism.layers import MaxPool2x2, is_plain_2x2

def vector_floats() -> int | None:
    """Floats per vector of the loaded build: 16 for AVX-512, 8 otherwise (None: no build could be loaded).
    Builds of the two widths give a fused run's numbers that differ at float32 rounding."""
    from fedprism.kernels.build import load

    return int(torch.ops.fedprism_kernels.vector_floats()) if load("fused") else None


def _pooled(n: int, k: int) -> int:
    return (n - k + 1) // 2


def _stem_fake(x: Tensor, w: Tensor, b: Tensor, k: int) -> Tensor:
    G, N, _, H, W = x.shape
    return x.new_empty(G, N, w.shape[1], _pooled(H, k), _pooled(W, k))


def _train_fake(x: Tensor, w: Tensor, b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    out = _stem_fake(x, w, b, k)
    return out, out.new_empty(out.shape, dtype=torch.uint8)


def _backward_fake(grad: Tensor, arg: Tensor, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    G, _, O = grad.shape[:3]
    return grad.new_empty(G, O, x.shape[2] * k * k), grad.new_empty(G, O)


def _block_backward_fake(grad: Tensor, arg: Tensor, x: Tensor, w: Tensor, k: int):
    G, _, O = grad.shape[:3]
    return grad.new_empty(G, O, w.shape[2]), grad.new_empty(G, O), x.new_empty(x.shape)


def _front(t: Tensor, d: int | None, M: int) -> Tensor:
    """`t` with its vmap dimension `d` moved to the front, expanded to M there if unbatched."""
    return t.movedim(d, 0) if d is not None else t.expand(M, *t.shape)


def _fold(t: Tensor, d: int | None, M: int) -> Tensor:
    """`t`'s vmap dimension merged into the kernel's group dimension: [M * G, ...]."""
    return _front(t, d, M).flatten(0, 1)


def _forward_vmap(op):
    """The vmap rule of a kernel forward (`stem_forward`, `stem_train_forward`; x [G, N, C, H, W],
    w [G, O, T], b [G, O]) over models: a shared input (unbatched, one group) runs all models' filters as
    one group; otherwise one group per (model, group)."""
    def rule(info, in_dims, x, w, b, k):
        xd, wd, bd, _ = in_dims
        M = info.batch_size
        if xd is None and x.shape[0] == 1:
            w, b = (_front(t, d, M).transpose(0, 1).flatten(1, 2) for t, d in ((w, wd), (b, bd)))
            res, dim, view = op(x, w, b, k), 2, (lambda t: t.unflatten(2, (M, -1)))   # [1, N, M, O, Hp, Wp]
        else:
            res, dim = op(_fold(x, xd, M), _fold(w, wd, M), _fold(b, bd, M), k), 0
            view = lambda t: t.unflatten(0, (M, -1))                                   # noqa: E731
        if isinstance(res, tuple):
            return tuple(view(t) for t in res), (dim,) * len(res)
        return view(res), dim
    return rule


def _backward_vmap(info, in_dims, grad, arg, x, k):
    gd, ad, xd, _ = in_dims
    M = info.batch_size
    x5 = x if xd is None and x.shape[0] == 1 else _fold(x, xd, M)    # one shared input stays one group
    dw, db = torch.ops.fedprism_kernels.stem_backward(_fold(grad, gd, M), _fold(arg, ad, M), x5, k)
    return (dw.unflatten(0, (M, -1)), db.unflatten(0, (M, -1))), (0, 0)


def _block_backward_vmap(info, in_dims, grad, arg, x, w, k):
    M = info.batch_size
    dw, db, dx = torch.ops.fedprism_kernels.block_backward(
        *(_fold(t, d, M) for t, d in zip((grad, arg, x, w), in_dims[:4])), k)
    return tuple(t.unflatten(0, (M, -1)) for t in (dw, db, dx)), (0, 0, 0)


def register_ops(names: tuple[str, ...]) -> None:
    """The fake (shape) and vmap rules of the ops `names` of a library just loaded (`fedprism.kernels.build`;
    once per process and library)."""
    lib, ops = "fedprism_kernels::", torch.ops.fedprism_kernels
    fakes = {"stem_forward": _stem_fake, "stem_train_forward": _train_fake,
             "stem_backward": _backward_fake, "block_backward": _block_backward_fake}
    vmaps = {"stem_backward": _backward_vmap, "block_backward": _block_backward_vmap}
    for name in names:
        if name in fakes:
            torch.library.register_fake(lib + name)(fakes[name])
        if name in ("stem_forward", "stem_train_forward"):
            torch.library.register_vmap(lib + name)(_forward_vmap(getattr(ops, name)))
        elif name in vmaps:
            torch.library.register_vmap(lib + name)(vmaps[name])


def conv_relu_pool(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``max_pool2d(relu(conv2d(x, w, b)), 2)`` for x [N, C, H, W], w [O, C, k, k] through the fused kernel
    (under ``torch.vmap`` over models through the kernels' vmap rule). Needs
    `fedprism.kernels.build.load("fused")`."""
    O, _, k, _ = w.shape
    return torch.ops.fedprism_kernels.stem_forward(x[None], w.reshape(1, O, -1), b[None], k)[0]


class FusedConvReLUPool(nn.Module):
    """``conv -> ReLU -> MaxPool2d(2)`` through the fused kernel on a CPU in float32, the plain layers
    otherwise. Holds the convolution's `weight` and `bias`
    under the convolution's names, so a flat parameter vector maps onto it as onto the model it replaces."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if x.device.type == "cpu" and x.dtype == w.dtype == b.dtype == torch.float32:
            return conv_relu_pool(x, w, b)
        return MaxPool2x2()(F.relu(F.conv2d(x, w, b)))


def _fusable(conv: nn.Module) -> bool:
    pair = lambda v: v if isinstance(v, tuple) else (v, v)
    return (type(conv) is nn.Conv2d and conv.bias is not None and conv.groups == 1
            and conv.padding_mode == "zeros"
            and pair(conv.stride) == (1, 1) and pair(conv.dilation) == (1, 1)
            and conv.padding in ((0, 0), 0, "valid") and conv.kernel_size[0] == conv.kernel_size[1])


def _fusable_triples(module: nn.Module) -> list[tuple[nn.Sequential, int]]:
    found = []
    for seq in module.modules():
        if isinstance(seq, nn.Sequential):
            kids = list(seq)
            for i in range(len(kids) - 2):
                if (_fusable(kids[i]) and type(kids[i + 1]) is nn.ReLU
                        and (is_plain_2x2(kids[i + 2]) or type(kids[i + 2]) is MaxPool2x2)):
                    found.append((seq, i))
    return found


def fuse_stems(module: nn.Module) -> nn.Module | None:
    """A copy of `module` (an inference copy: see `fedprism.models.pooling.for_inference`) with every
    qualifying ``Conv2d -> ReLU -> MaxPool2d(2)`` replaced by :class:`FusedConvReLUPool` and two ``nn.Identity`` (parameter names
    unchanged), or None when nothing qualifies."""
    if not _fusable_triples(module):
        return None
    out = copy.deepcopy(module)
    for seq, i in _fusable_triples(out):
        seq[i], seq[i + 1], seq[i + 2] = FusedConvReLUPool(seq[i]), nn.Identity(), nn.Identity()
    return out


# -- training (`train.kernels = fused`) -------------------------------------------------------------------
class StemSplit:
    """The training gradient of a model whose first layers are a qualifying ``Conv2d -> ReLU -> MaxPool2d(2)``
    (``body[0:3]`` of a model with `body` and `head`, no dropout), with that block fused, and the next block
    ``body[3:6]`` too where it qualifies (LeNet-5's second).

    `grad_and_value(objective)` returns ``(flat, x, y, weight, extras) -> (gradient, loss)``, vmap- and
    compile-safe, in three steps (chain rule, no autograd through the kernels):
      1. h, arg = the blocks' outputs on x and each output's winning window corner (the kernels' forwards);
      2. torch.func differentiates the objective with respect to the flat vector and to the last block's
         output h, the rest of the model running from h (`WithStem`);
      3. the kernels' backwards, last block first: its filter and bias gradients and the gradient of its
         input (`block_backward`), then the first block's filter and bias gradients (`stem_backward`), added
         to the flat gradient (an objective's own terms on those parameters, e.g. FedProx's, come from 2).
    The gradients are PyTorch's in exact arithmetic (`tests/test_fused_kernels.py` checks it exactly on
    integer inputs); in float32 they are summed in another order.
    """

    NAMES = ("body.0.weight", "body.0.bias")
    SECOND = ("body.3.weight", "body.3.bias")

    def __init__(self, f):
        self.f = f
        body, spec = f.module.body, f.spec
        self.blocks = [(body[0].weight.shape, 0)]
        two = (len(body) >= 6 and (body, 3) in _fusable_triples(body)
               and spec.names[2:4] == self.SECOND)
        if two:
            self.blocks.append((body[3].weight.shape, spec.offsets[2]))
        self.names = self.NAMES + (self.SECOND if two else ())
        self.rest = copy.deepcopy(f.module)
        for i in range(3 * len(self.blocks)):
            self.rest.body[i] = nn.Identity()
        last_shape, last_at = self.blocks[-1]
        self.n = last_at + last_shape.numel() + last_shape[0]     # the fused blocks' parameters: flat[:n]
        assert spec.names[:2] == self.NAMES and spec.offsets[len(self.names)] == self.n, spec.names[:4]

    @staticmethod
    def qualifies(f) -> bool:
        body = getattr(f.module, "body", None)
        return (not f.dropout and isinstance(body, nn.Sequential) and hasattr(f.module, "head")
                and len(body) >= 3 and (body, 0) in _fusable_triples(body)
                and f.spec.names[:2] == StemSplit.NAMES)

    def grad_and_value(self, objective):
        from torch.func import grad_and_value

        ops, n = torch.ops.fedprism_kernels, self.n
        blocks = [(shape[0], shape[2], shape.numel(), at) for shape, at in self.blocks]   # O, k, |w|, offset

        def loss_of(flat, h, x, y, wt, extras):
            return objective(WithStem(self, h, x, flat), flat, x, y, wt, extras)

        gv = grad_and_value(loss_of, argnums=(0, 1))

        def step(flat, x, y, wt, extras):
            ins, args, wts = [x[None]], [], []
            for O, k, nw, at in blocks:
                w, b = flat[at:at + nw].reshape(1, O, -1), flat[at + nw:at + nw + O].reshape(1, O)
                h, arg = ops.stem_train_forward(ins[-1], w, b, k)
                ins.append(h)
                args.append(arg)
                wts.append(w)
            (g, gh), loss = gv(flat, ins[-1][0], x, y, wt, extras)
            grads, gh = [], gh[None]
            for i in range(len(blocks) - 1, 0, -1):
                dw, db, gh = ops.block_backward(gh, args[i], ins[i], wts[i], blocks[i][1])
                grads[:0] = [dw[0].reshape(-1), db[0]]
            dw, db = ops.stem_backward(gh, args[0], x[None], blocks[0][1])
            grads[:0] = [dw[0].reshape(-1), db[0]]
            return torch.cat([g[:n] + torch.cat(grads), g[n:]]), loss

        return step


class WithStem:
    """What an objective sees as `f` under `StemSplit`: the model evaluated from the block's output `h`,
    which was computed from the batch `x` with the parameters `flat`. An objective that evaluates the
    model on any other input or at any other parameters (APFL's mixed model, Per-FedAvg's inner step) is
    refused: `h` would be the wrong block output, and it has no gradient there."""

    def __init__(self, split: StemSplit, h: Tensor, x: Tensor, flat: Tensor):
        self.split, self.h, self.x, self.flat = split, h, x, flat
        self.spec, self.module = split.f.spec, split.f.module

    def _params(self, flat):
        return {n: v for n, v in self.spec.unflatten(flat).items() if n not in self.split.names}

    def _check(self, flat, x):
        if x is not self.x or flat is not self.flat:
            raise RuntimeError("train.kernels=fused: the objective evaluates the model on another input or "
                               "at other parameters than its batch and its own; run it with "
                               "train.kernels=aten")

    def __call__(self, flat, x):
        self._check(flat, x)
        return torch.func.functional_call(self.split.rest, (self._params(flat), self.split.f.buffers),
                                          (self.h,))

    def features(self, flat, x):
        self._check(flat, x)
        return torch.func.functional_call(self.split.rest, (self._params(flat), self.split.f.buffers),
                                          (self.h,), {"features_only": True})

    def head(self, flat, z):
        return self.split.f.head(flat, z)


__all__ = ["FusedConvReLUPool", "StemSplit", "WithStem", "conv_relu_pool", "fuse_stems", "register_ops",
           "vector_floats"]
