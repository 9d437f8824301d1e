"""Per-user feature shift with shared class meanings (`user_shift`): a Dirichlet label split (`dirichlet`, per
client over classes, equal sizes) and, for every client, one fixed transform of its images drawn once from the
run seed: a rotation, a translation, a contrast and brightness change and Gaussian pixel noise.

It stands in for a federation of people (the WISDM users of FedSub: Campana and Delmastro, "FedSub:
Introducing Class-aware Subnetworks Fusion to Enhance Personalized Federated Learning") on an image data set
that needs no download: each user "writes" or "records" the same classes in its own style (the transform),
so a class means the same on every client while the inputs of one class differ from user to user. FedProx's
Synthetic(1, 1) data (Li et al. 2020, arXiv:1812.06127), the earlier substitute, gives every user its own
labelling function instead, so the same label means different things on two clients and class-level fusion
across clients has nothing to share.

Client i's transform, from the stream ``numpy.random.default_rng([seed, SHIFT_STREAM, i])`` (drawn in this
order, each uniform):

    angle_i  in [-max_rotation, max_rotation] degrees
    dx_i, dy_i in [-max_shift, max_shift] pixels
    a_i      in [1 - contrast, 1 + contrast]       (multiplies the normalised image)
    b_i      in [-brightness, brightness]          (added, in units of the normalised inputs)
    s_i      in [0, noise]                         (std of the Gaussian pixel noise)

    x' = a_i * warp(x; angle_i, dx_i, dy_i) + b_i + s_i * eps,   eps ~ N(0, 1) per pixel

``warp`` rotates about the image centre and translates with bilinear sampling
(``torch.nn.functional.grid_sample``, ``align_corners=False``, the border pixel repeated outside the image so
that the background stays the background in normalised units). The noise is drawn once per client and split
from ``[seed, SHIFT_STREAM, i, 1 + SPLITS[split]]`` (float32), like `feature_noise`; the client's local test
rows get the client's transform (its own style), the global test set stays as it is.
"""

from __future__ import annotations

import math

import numpy as np

from fedprism.data.partitions import dirichlet
from fedprism.data.partitions.base import PARTITIONS, PartitionSpec, _positive_finite
from fedprism.hparams import Param

#: a constant of the transform streams, independent of every other stream of the run seed
SHIFT_STREAM = 0x5F17

#: the noise stream of each split a client's rows come from
SPLITS = {"train": 0, "test": 1}


def split(y, num_classes, num_clients, min_train, rng, params):
    """The labels are split as `dirichlet` does (``alpha``); the shift is in the inputs (`perturb`,
    `user_transform` gives a client's parameters)."""
    return dirichlet.split(y, num_classes, num_clients, min_train, rng, params)


def user_transform(client: int, seed: int, params: dict) -> tuple[float, float, float, float, float, float]:
    """(angle in degrees, dx, dy in pixels, contrast a, brightness b, noise std s) of one client."""
    g = np.random.default_rng([int(seed), SHIFT_STREAM, int(client)])
    r, t, c = params["max_rotation"], params["max_shift"], params["contrast"]
    angle = float(g.uniform(-r, r))
    dx, dy = (float(v) for v in g.uniform(-t, t, size=2))
    a = float(g.uniform(1 - c, 1 + c))
    b = float(g.uniform(-params["brightness"], params["brightness"]))
    s = float(g.uniform(0, params["noise"]))
    return angle, dx, dy, a, b, s


def warp(x, angle: float, dx: float, dy: float):
    """Images x [n, C, H, W] rotated by `angle` degrees about their centre (positive: clockwise as displayed,
    row 0 at the top; 90 is ``torch.rot90(x, -1, (2, 3))``) and moved by (dx, dy) pixels (positive dx: to the
    right, positive dy: down; whole pixels move exactly), bilinear, the border repeated."""
    import torch
    import torch.nn.functional as F

    if angle == 0 and dx == 0 and dy == 0:
        return x
    n, _, h, w = x.shape
    th = math.radians(angle)
    cos, sin = math.cos(th), math.sin(th)
    # output pixel p samples input R^-1 (p - t) in normalised coordinates ([-1, 1] over the width / height)
    tx, ty = 2.0 * dx / w, 2.0 * dy / h
    inv = torch.tensor([[cos, sin * h / w, -(cos * tx + sin * ty * h / w)],
                        [-sin * w / h, cos, -(-sin * tx * w / h + cos * ty)]], dtype=torch.float64)
    grid = F.affine_grid(inv.to(x.dtype)[None].expand(n, 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def perturb(x, client: int, num_clients: int, split: str, seed: int, params: dict):
    """Client ``client``'s rows ``x`` of ``split`` as that client holds them (its fixed transform)."""
    import torch

    from fedprism.errors import ConfigError

    if x.numel() == 0:
        return x
    if x.dim() != 4:
        raise ConfigError("partition", "user_shift", f"a dataset of images [N, C, H, W]: user_shift rotates and "
                          f"moves images, and this dataset's inputs have shape {tuple(x.shape)}")
    angle, dx, dy, a, b, s = user_transform(client, seed, params)
    out = warp(x, angle, dx, dy) * np.float32(a) + np.float32(b)
    if s > 0:
        rng = np.random.default_rng([int(seed), SHIFT_STREAM, int(client), 1 + SPLITS[split]])
        out = out + torch.from_numpy(rng.standard_normal(tuple(x.shape), dtype=np.float32)) * np.float32(s)
    return out.contiguous()


def _nonneg(v) -> bool:
    return math.isfinite(v) and v >= 0


SPEC = PARTITIONS.register(PartitionSpec("user_shift", split, {
    "alpha": Param(0.5, "Dirichlet concentration of each client's class pmf (as `dirichlet`)", _positive_finite,
                   "a finite number > 0"),
    "max_rotation": Param(30.0, "largest rotation of a client's images, degrees (each client: uniform in "
                          "[-max, max])", lambda v: math.isfinite(v) and 0 <= v <= 180, "a number in [0, 180]"),
    "max_shift": Param(3.0, "largest translation of a client's images, pixels, each axis", _nonneg,
                       "a finite number >= 0"),
    "contrast": Param(0.3, "a client multiplies its normalised images by a in [1 - contrast, 1 + contrast]",
                      lambda v: math.isfinite(v) and 0 <= v < 1, "a number in [0, 1)"),
    "brightness": Param(0.3, "a client adds b in [-brightness, brightness] (normalised units)", _nonneg,
                        "a finite number >= 0"),
    "noise": Param(0.2, "a client's Gaussian pixel noise has std in [0, noise] (normalised units)", _nonneg,
                   "a finite number >= 0"),
}, title="per-user feature shift: Dirichlet labels, one fixed rotation, translation, contrast, brightness "
         "and noise per client (a FedSub substitute for per-user data)", perturb=perturb))
