"""FedSub (Campana and Delmastro, "FedSub: Introducing Class-aware Subnetworks Fusion to Enhance Personalized
Federated Learning"; the text we worked from states neither a year nor an arXiv identifier): class
prototypes clustered per class on the server, class-level subnetworks fused inside each cluster, and a
personalised partial overwrite of every client's model. Algorithm 1 (client) and Algorithm 2 (server):

    client k (round t), holding its model theta_k (client state `w`):
      theta_k <- theta_k with the server's update U_k written where U_k has entries     Alg. 1 line 13
      theta_k <- E epochs of cross-entropy on D_k                                        Alg. 1 line 2
      P_k^c = mean_{x in D_k^c} f(x)   for every local class c                           Eq. 1
      r_k^c = reliability score (`reliability`: 1, |D_k^c|, class-c accuracy, or both)  Alg. 1 line 5
      M_k^c = neuron mask of class c:                                                    Alg. 1 lines 6-7
                naive: neurons whose mean activation over D_k^c is > 0                   Eq. 2
                LRP:   neurons whose mean relevance over D_k^c is > 0                    Eqs. 3-5
      S_k^c = theta_k (.) M_k^c   (a neuron's parameters: its incoming weight row and its bias)  line 8
      -> server: P_k^c, S_k^c with M_k^c, r_k^c for every local class                    line 11
    server (round t):
      cache[k] <- the artifacts of every participant, with the round they were made      Alg. 2 lines 4-6
      for each class c: K-Means on the cached {P_k^c}, K in [2, n_c - 1] with the lowest
                        Davies-Bouldin index                                              line 7
      for each cluster G of class c, the fused subnetwork Sbar_G:                         line 9
        avg:        Sbar_G = sum_{k in G} r_k^c S_k^c / sum_{k in G} r_k^c                Eq. 6
        leadership: Sbar_G = S_l^c,  l = argmax_{k in G} r_k^c                           Eq. 8
        overlap:    Eq. 6 on the neurons in the mask of every member of G, 0 elsewhere   Eq. 9
      U_k = element-wise average of the Sbar_G of the clusters k belongs to               Eqs. 7, 8, 10
            (overlap: only where all of those clusters share the neuron; elsewhere k keeps its own)
      -> client k: U_k                                                                    line 11

Decisions where the paper is silent or ambiguous:

* Round order. A fedprism round is plan -> client work -> aggregate, so the server's answer of round t
  (U_k from the artifacts of rounds <= t) reaches client k at the start of its next round (or its
  evaluation), and the client writes it into its model before training: Algorithm 1's line 13 followed
  by line 2 of the next round. Evaluation scores the client's model with its current U_k written in.
* Models. Subnetworks are defined on neurons of dense layers: FedSub needs a ReLU MLP (`mlp`, `mlp_fedsub`:
  Linear layers, ReLU, no normalisation; the layout is read from `ParamSpec.layers`, never from names, and
  the first client update checks that the reconstructed forward pass equals the engine's logits).
* Output layer. Class c's subnetwork holds row c of the last layer (weights and bias) and no other output
  row: LRP starts from logit c, and "positive activation" of a logit means nothing for the naive rule.
* Masks are explicit. Every upload carries its neuron masks [C, U] (U = neurons with parameters; one bit
  each on the wire, "Communication" below), so a trained weight that is exactly 0 is still part of a
  subnetwork (the paper reads relevance from non-zero entries).
* Eq. 6 / Eq. 7 "element-wise average among a set of parameter matrices": every element is averaged over
  the subnetworks (Eq. 6) or fused subnetworks (Eq. 7) whose mask contains it; averaging in the zeros of
  absent entries would shrink the weights.
* Eq. 10 (overlap) across classes: a hidden neuron is written only when it is in the fused mask of every
  cluster k belongs to; output row c belongs to class c's cluster only, so it is written when that
  cluster's fused mask has it.
* LRP. The relevance of the output layer is max(logit_c, 0) at neuron c, 0 elsewhere: the alpha-beta rule
  assumes a positive logit, so a sample whose class-c logit is not positive contributes no relevance.
  Rules in `fedprism.explain.lrp` (bias left out of the alpha-beta denominators). `lrp_eps` (epsilon
  rule, `lrp_eps` = eps) is an extra the paper does not use.
* Prototypes (`prototypes`). Eq. 1 names "the feature extraction function" f as FedProto and ProtoHAR
  do, whose f is the model's embedding, yet Section 4.4 says the prototypes "remain unchanged throughout
  the whole simulation" on static data and Algorithm 1 updates them only "whenever the local dataset
  changes", which needs a fixed f. `features` (default): FedProto's Eq. 4 with the model's penultimate
  features after local training, on the whole train split (`fedproto.local_prototypes`), recomputed every
  round since f changes with the model. `input`: f is the identity on the flattened input (the MLP's input
  vector), so a prototype is a class mean of the raw samples; the client keeps it in its state with a
  signature of its train split (size and sums) and computes it again only when that split changes (class
  drift), so with `privacy.epsilon` each data state is released once. Either way `privacy.epsilon`
  releases prototypes with DP; subnetworks and scores are sent without noise (the paper's privacy section
  covers prototypes only).
* Reliability (Section 4.3's four options): `uniform` 1 (the paper's reported setting, default),
  `samples` |D_k^c|, `accuracy` the trained model's accuracy on the client's class-c train samples,
  `combined` |D_k^c| x accuracy. Scores are divided by the maximum inside each cluster; a cluster whose
  scores are all 0 uses equal scores. Leadership ties go to the lowest client index.
* Clustering over the cache: every client's latest artifacts, each stored with the round it was made
  (`made`); a class's members are the cached clients whose latest upload holds a subnetwork of it.
  K-Means (`clustering.kmeans.kmeans`: k-means++, 10 restarts, seeded by (seed, round, class)) for K in
  [2, n_c - 1] with the lowest Davies-Bouldin index (`clustering.select_k.choose_k_davies_bouldin`; the
  chosen K's labels are kept, not fitted again); one cluster when n_c <= 2 or the
  prototypes allow no K (all equal). The paper's upper end "the number of available prototypes" would make
  every prototype its own cluster and Davies-Bouldin is undefined there.
* All cached clients are clustered every round, sampled or not; the server's answer to a client that has
  never uploaded is empty (it keeps its model).
* Communication: sparse subnetworks (`encode` / `decode`; the runner counts `wire_bytes`, and the Flower
  codec sends exactly these arrays, so the counted bytes are what travels). In memory the rows keep their
  fixed shapes (theta_k [P] zero outside the union of its masks, masks [C, U] uint8; U_k [P] zero outside
  its written neurons, write [U] uint8). One client's message travels as
    up:    'masks'  the class masks [C, U] as bits, row-major (class by class, neuron by neuron in the
                    flat vector's layer order), most significant bit first, zero-padded to whole bytes:
                    ceil(C U / 8) bytes (uint8);
           'params' the parameters of the neurons in the union of the masks (a neuron's weight row and
                    bias), in the flat vector's order: 4 bytes each (float32); each kept parameter once,
                    however many class subnetworks hold it;
           'protos' [C, d] ([C, input width] with `prototypes=input`) and 'scores' [C], dense (4
                    bytes each): every class's row travels, as
                    `privacy.epsilon` releases every class's prototype;
    down:  'write'  the written neurons [U] as bits, ceil(U / 8) bytes; 'values' the parameters of the
                    written neurons, 4 bytes each (the same for the evaluation payload).
  Decoding puts the values back at the neurons the bits name and zeros elsewhere, which is the row that
  was encoded, bit for bit: a kept weight that is exactly 0 travels as a value (the mask, not the value,
  says it is kept). A malformed message (bit string of another length, non-zero padding bits, another
  number of values than the bits ask for) is refused naming the field. Per client up: 4 |union| +
  ceil(C U / 8) + 4 C d + 4 C bytes, against 4 P for FedAvg's full model; down: 4 |written| +
  ceil(U / 8). The paper's Figure 6 counts each class subnetwork separately (shared parameters once per
  class); `subnetwork_bytes` gives that measure and the union's from the uploaded masks, and `aggregate`
  records both every round (record `fedsub`).

Defaults (paper, Section 4.3): one local epoch, all clients every round, SGD, equal reliability, the
MLP input-128-512-classes (`model=mlp_fedsub`); Overlapping Components is the paper's best fusion and the
default here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update, register
from fedprism.algorithms.fedproto import check_feature_dim, local_prototypes
from fedprism.errors import ConfigError
from fedprism.explain import lrp
from fedprism.hparams import Param
from fedprism.params import ParamSpec

SUBNETWORKS = ("naive", "lrp_a1b0", "lrp_a2b1", "lrp_eps")
FUSIONS = ("avg", "leadership", "overlap")
RELIABILITY = ("uniform", "samples", "accuracy", "combined")
PROTOTYPES = ("features", "input")
#: (rule, alpha, beta) of each LRP variant
LRP_RULES = {"lrp_a1b0": ("alpha_beta", 1.0, 0.0), "lrp_a2b1": ("alpha_beta", 2.0, 1.0), "lrp_eps": ("epsilon", 1.0, 0.0)}
CHUNK = 1024


# -- the neurons of a flat vector -------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Dense layers of a ReLU MLP in the flat vector: per layer the weight slice [out, in] and bias slice."""

    weights: tuple[slice, ...]
    biases: tuple[slice, ...]
    shapes: tuple[tuple[int, int], ...]
    size: int

    @property
    def units(self) -> int:
        return sum(o for o, _ in self.shapes)

    @property
    def unit_offsets(self) -> list[int]:
        return list(np.cumsum([0] + [o for o, _ in self.shapes]))

    def unit_of_param(self) -> torch.Tensor:
        """[P] long: the neuron each parameter belongs to (weight row j and bias j: neuron j of its layer)."""
        idx = torch.empty(self.size, dtype=torch.long)
        for (o, i), ws, bs, u0 in zip(self.shapes, self.weights, self.biases, self.unit_offsets):
            idx[ws] = (u0 + torch.arange(o)).repeat_interleave(i)
            idx[bs] = u0 + torch.arange(o)
        return idx

    def layers(self, flat: torch.Tensor) -> list[lrp.Layer]:
        return [(flat[ws].view(o, i), flat[bs]) for (o, i), ws, bs in zip(self.shapes, self.weights, self.biases)]

    def class_domain(self, num_classes: int) -> torch.Tensor:
        """[C, U] bool: the neurons a class subnetwork may hold (every hidden neuron, output neuron c)."""
        dom = torch.zeros(num_classes, self.units, dtype=torch.bool)
        out0 = self.unit_offsets[-2]
        dom[:, :out0] = True
        dom[torch.arange(num_classes), out0 + torch.arange(num_classes)] = True
        return dom


def mlp_layout(spec: ParamSpec, num_classes: int) -> Layout:
    """The dense-layer layout of `spec`, or a ConfigError when the model is not a chain of Linear layers."""
    why = None
    ws, bs, shapes = [], [], []
    for _, sl in spec.layers:
        idx = [i for i in range(len(spec.names)) if sl.start <= spec.offsets[i] < sl.stop]
        sh = [spec.shapes[i] for i in idx]
        if len(sh) != 2 or len(sh[0]) != 2 or sh[1] != (sh[0][0],):
            why = f"a layer with parameter shapes {sh} (only Linear layers with a bias)"
            break
        a = sl.start
        ws.append(slice(a, a + sh[0][0] * sh[0][1]))
        bs.append(slice(a + sh[0][0] * sh[0][1], sl.stop))
        if shapes and shapes[-1][0] != sh[0][1]:
            why = f"layer widths that do not chain ({shapes[-1][0]} -> {sh[0][1]})"
            break
        shapes.append(sh[0])
    if why is None and (not shapes or shapes[-1][0] != num_classes):
        why = "no output layer with one neuron per class"
    if why is not None:
        raise ConfigError("model", f"a model with {why}", "a ReLU MLP (model=mlp or mlp_fedsub): FedSub's class "
                          "subnetworks are sets of neurons of dense layers")
    return Layout(tuple(ws), tuple(bs), tuple(shapes), spec.size)


# -- client side ----------------------------------------------------------------------------------------------
def class_subnetworks(layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                      how: str, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One client's neuron masks [C, U] bool (Eqs. 2 and 4), its class counts [C] and class accuracies [C]
    on (x, y) with model w [P]. A class without samples has an empty mask, count 0 and accuracy 0."""
    layers = [(a.double(), b.double()) for a, b in layout.layers(w.detach().cpu())]
    x, y = x.cpu(), y.cpu()
    U, off = layout.units, layout.unit_offsets
    out0 = off[-2]
    masks = torch.zeros(num_classes, U, dtype=torch.bool)
    counts = torch.bincount(y, minlength=num_classes).double()
    correct = torch.zeros(num_classes, dtype=torch.float64)
    for c in torch.nonzero(counts > 0).flatten().tolist():
        xc = x[y == c]
        score = torch.zeros(out0, dtype=torch.float64)         # summed activation / relevance of hidden neurons
        for s in range(0, len(xc), CHUNK):
            acts = lrp.forward(layers, xc[s:s + CHUNK].double())
            logits = acts[-1]
            correct[c] += (logits.argmax(-1) == c).sum()
            if how == "naive":
                score += torch.cat([a.sum(0) for a in acts[1:-1]])
            else:
                rule, alpha, beta = LRP_RULES[how]
                start = torch.zeros_like(logits)
                start[:, c] = logits[:, c].clamp(min=0)
                rel = lrp.relevance(layers, acts, start, rule, alpha, beta, eps)
                score += torch.cat([r.sum(0) for r in rel[1:-1]])
        masks[c, :out0] = score > 0                # mean > 0 <=> sum > 0
        masks[c, out0 + c] = True
    return masks, counts, correct / counts.clamp(min=1)


def reliability(how: str, counts: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """r_k^c for every class (before the per-cluster normalisation): Section 4.3's four options."""
    r = {"uniform": torch.ones_like(counts), "samples": counts, "accuracy": acc, "combined": counts * acc}[how]
    return torch.where(counts > 0, r, torch.zeros_like(r)).float()


def subnetwork_bytes(masks: torch.Tensor, layout: Layout, value_bytes: int = 4) -> dict:
    """Bytes of a client's class subnetworks (masks [C, U]) in sparse form: `separate` counts each class's
    parameters once per subnetwork (the paper's Figure 6), `union` each kept parameter once; plus one bit
    per neuron and class for the masks. `full_model` is the dense model for comparison."""
    unit = layout.unit_of_param()
    per_unit = torch.bincount(unit, minlength=layout.units).to(torch.float64)        # parameters per neuron
    m = masks.to(torch.bool)
    bits = m.shape[0] * layout.units / 8.0
    return {"separate": float((m.double() @ per_unit).sum()) * value_bytes + bits,
            "union": float(per_unit[m.any(0)].sum()) * value_bytes + bits,
            "full_model": float(layout.size * value_bytes)}


# -- the wire -------------------------------------------------------------------------------------------------
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[1, ceil(n / 8)] uint8: the n entries of a bool mask (row-major), one bit each, most significant bit
    first, zero-padded to whole bytes."""
    return torch.from_numpy(np.packbits(mask.detach().cpu().reshape(-1).numpy().astype(bool)))[None]


def _one_row(wire: dict, name: str, dtype: torch.dtype | None = None, floating: bool = False) -> torch.Tensor:
    t = wire.get(name)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"field {name!r} missing")
    if t.dim() != 2 or t.shape[0] != 1:
        raise ValueError(f"field {name!r}: one row [1, n] expected, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"field {name!r}: dtype {t.dtype}, expected {dtype}")
    if floating and not t.is_floating_point():
        raise ValueError(f"field {name!r}: dtype {t.dtype}, expected floating point")
    return t[0]


def unpack_bits(wire: dict, name: str, n: int) -> torch.Tensor:
    """[n] bool from `pack_bits`'s bytes `wire[name]`; ValueError naming the field when the byte string has
    another length than ceil(n / 8), another dtype than uint8, or a padding bit set."""
    b = _one_row(wire, name, torch.uint8)
    if b.numel() != (n + 7) // 8:
        raise ValueError(f"field {name!r}: {b.numel()} bytes, expected ceil({n} / 8) = {(n + 7) // 8}")
    bits = np.unpackbits(b.numpy())
    if bits[n:].any():
        raise ValueError(f"field {name!r}: padding bits after the {n} mask bits must be 0")
    return torch.from_numpy(bits[:n].astype(bool))


def sparse_values(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[1, k]: the entries of `values` [P] where `keep` [P] bool, in flat order."""
    return values[keep.to(values.device)].cpu()[None]


def dense_values(wire: dict, name: str, keep: torch.Tensor) -> torch.Tensor:
    """[1, P]: `wire[name]`'s values at the entries where `keep` [P] bool, zeros elsewhere; ValueError naming
    the field when the number of values is not the number of kept entries."""
    v = _one_row(wire, name, floating=True)
    k = int(keep.sum())
    if v.numel() != k:
        raise ValueError(f"field {name!r}: {v.numel()} values, the mask keeps {k} parameters")
    out = torch.zeros(keep.shape[0], dtype=v.dtype)
    out[keep] = v
    return out[None]


# -- server side ----------------------------------------------------------------------------------------------
def fuse(theta: torch.Tensor, masks: torch.Tensor, r: torch.Tensor, fusion: str, unit: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused subnetwork of one cluster (Eqs. 6, 8, 9): (values [P] float64, neuron mask [U] bool).

    theta [m, P] the members' models, masks [m, U] bool their class masks, r [m] their scores."""
    r = r.to(torch.float64)
    r = r / r.max() if r.max() > 0 else torch.ones_like(r)          # normalised by the cluster's maximum
    if fusion == "leadership":
        lead = int(torch.argmax(r))                                 # first maximum: lowest client index
        mask = masks[lead]
        return torch.where(mask[unit], theta[lead].to(torch.float64), torch.zeros((), dtype=torch.float64)), mask
    if fusion == "overlap":
        mask = masks.all(0)
        a = r[:, None].expand(-1, theta.shape[1]) * mask[unit].to(torch.float64)
    elif fusion == "avg":
        mask = masks.any(0)
        a = r[:, None] * masks[:, unit].to(torch.float64)          # [m, P]: only members that hold the element
    else:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    den = a.sum(0)
    num = (a * theta.to(torch.float64)).sum(0)
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num)), mask


def personal_update(fused: list[tuple[torch.Tensor, torch.Tensor]], classes: list[int], fusion: str,
                    domain: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U_k (Eqs. 7, 8, 10): (values [P] float32, written neurons [U] bool) from the fused subnetworks of the
    clusters k belongs to (`classes[i]`: the class of `fused[i]`)."""
    P, U = unit.shape[0], domain.shape[1]
    if not fused:
        return torch.zeros(P), torch.zeros(U, dtype=torch.bool)
    vals = torch.stack([v for v, _ in fused])                         # [m, P]
    held = torch.stack([m for _, m in fused]) & domain[classes]       # [m, U]
    if fusion == "overlap":       # a neuron is written only if every cluster whose class may hold it has it
        dom = domain[classes]
        write = (held.sum(0) == dom.sum(0)) & (dom.sum(0) > 0)
    else:
        write = held.any(0)
    a = (held & write)[:, unit].to(torch.float64)                    # [m, P]
    den = a.sum(0)
    out = torch.where(den > 0, (a * vals).sum(0) / den.clamp(min=1e-300), torch.zeros(P, dtype=torch.float64))
    return out.float(), write


def cluster_class(protos: np.ndarray, seed: int) -> tuple[np.ndarray, dict]:
    """K-Means labels of one class's cached prototypes, K in [2, n - 1] by Davies-Bouldin (1 cluster if none)."""
    from fedprism.clustering.select_k import choose_k_davies_bouldin

    if protos.shape[0] <= 2:
        return np.zeros(protos.shape[0], dtype=np.int64), {}
    _, scores, labels = choose_k_davies_bouldin(protos, seed=seed, return_labels=True)
    return labels, scores


@register
class FedSub(Algorithm):
    name = "fedsub"
    paper = "Campana and Delmastro, FedSub: Introducing Class-aware Subnetworks Fusion to Enhance Personalized FL"
    params = {
        "subnetwork": Param("naive", "class subnetworks: naive (positive mean activation, Eq. 2), lrp_a1b0 / "
                            "lrp_a2b1 (positive mean LRP-alpha-beta relevance, Eq. 5) or lrp_eps (LRP-epsilon, "
                            "not in the paper)", choices=SUBNETWORKS),
        "fusion": Param("overlap", "cluster fusion: avg (Cluster AVG, Eq. 6), leadership (Eq. 8) or overlap "
                        "(Overlapping Components, Eqs. 9-10)", choices=FUSIONS),
        "reliability": Param("uniform", "reliability score r_k^c: uniform (1), samples (|D_k^c|), accuracy "
                             "(class-c train accuracy) or combined (samples x accuracy)", choices=RELIABILITY),
        "lrp_eps": Param(1e-6, "epsilon of subnetwork=lrp_eps", lambda v: v > 0, "a number > 0"),
        "prototypes": Param("features", "f of Eq. 1: features (the model's penultimate features, every round) "
                            "or input (class means of the raw input, kept until the client's data change)",
                            choices=PROTOTYPES, new=True),
    }
    client_state = {"w": ClientState(("P",), init="model")}
    shares_prototypes = True             # `privacy.epsilon` releases them with DP (fedprism.privacy)

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        check_feature_dim(ctx, self.name)
        self.layout = mlp_layout(ctx.spec, ctx.num_classes)
        self.unit = self.layout.unit_of_param()
        self.domain = self.layout.class_domain(ctx.num_classes)
        self._checked = False
        self.proto_dim = self.layout.shapes[0][1] if self.hp["prototypes"] == "input" else "d"
        if self.hp["prototypes"] == "input":     # the client keeps its input prototypes and their data's signature
            self.client_state = {**type(self).client_state,
                                 "pin": ClientState(("C", self.proto_dim), init="zeros"),
                                 "pkey": ClientState((3,), init=-1.0, dtype=torch.float64)}

    @classmethod
    def headline(cls, config: dict) -> str:
        return "own model with the fused class subnetworks written in"

    def upload(self) -> dict:
        U = self.layout.units
        return {"params": TensorSpec(("P",)), "masks": TensorSpec(("C", U), torch.uint8, low=0, high=2),
                "protos": TensorSpec(("C", self.proto_dim)), "scores": TensorSpec(("C",), low=0)}

    def init_state(self) -> dict:
        N, C, U, P = self.ctx.num_clients, self.ctx.num_classes, self.layout.units, self.ctx.spec.size
        d = self.ctx.feature_dim if self.proto_dim == "d" else self.proto_dim
        return {"params": torch.zeros(N, P), "masks": torch.zeros(N, C, U, dtype=torch.uint8),
                "protos": torch.zeros(N, C, d), "scores": torch.zeros(N, C),
                "made": torch.full((N,), -1, dtype=torch.long),            # round of each client's artifacts
                "assign": torch.full((C, N), -1, dtype=torch.long)}        # cluster of client k for class c

    # -- the server's answer --------------------------------------------------------------------------------
    def updates_for(self, state: dict, clients: np.ndarray) -> dict:
        """U_k for each client: {'values': [n, P], 'write': [n, U] uint8}."""
        masks = state["masks"].to(torch.bool)
        fused_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        vals, writes = [], []
        for k in clients:
            k = int(k)
            fused, classes = [], []
            for c in torch.nonzero(state["assign"][:, k] >= 0).flatten().tolist():
                g = int(state["assign"][c, k])
                if (c, g) not in fused_cache:
                    m = torch.nonzero(state["assign"][c] == g).flatten()
                    fused_cache[c, g] = fuse(state["params"][m], masks[m, c] & self.domain[c], state["scores"][m, c],
                                             self.hp["fusion"], self.unit)
                fused.append(fused_cache[c, g])
                classes.append(c)
            v, w = personal_update(fused, classes, self.hp["fusion"], self.domain, self.unit)
            vals.append(v)
            writes.append(w.to(torch.uint8))
        return {"values": torch.stack(vals), "write": torch.stack(writes)}

    # -- the wire: sparse subnetworks (module docstring, "Communication") ---------------------------------------
    def encode(self, kind: str, row: dict) -> dict:
        if kind == "update":
            masks = row["masks"][0].to(torch.bool)                                  # [C, U]
            return {"params": sparse_values(row["params"][0], masks.any(0)[self.unit]), "masks": pack_bits(masks),
                    "protos": row["protos"], "scores": row["scores"]}
        if kind in ("plan", "eval"):
            write = row["write"][0].to(torch.bool)                                  # [U]
            return {"values": sparse_values(row["values"][0], write[self.unit]), "write": pack_bits(write)}
        raise ValueError(f"kind must be one of {self.WIRE_KINDS}, got {kind!r}")

    def decode(self, kind: str, wire: dict) -> dict:
        C, U = self.ctx.num_classes, self.layout.units
        names = {"update": ("masks", "params", "protos", "scores"), "plan": ("values", "write"),
                 "eval": ("values", "write")}.get(kind)
        if names is None:
            raise ValueError(f"kind must be one of {self.WIRE_KINDS}, got {kind!r}")
        odd = sorted(set(names) ^ set(wire))
        if odd:
            raise ValueError(f"field {odd[0]!r} {'missing' if odd[0] in names else 'unexpected'}: a FedSub {kind} "
                             f"message holds {', '.join(names)}")
        if kind == "update":                   # 'protos' and 'scores' travel dense (checked against `upload`)
            masks = unpack_bits(wire, "masks", C * U).view(C, U)
            return {"params": dense_values(wire, "params", masks.any(0)[self.unit]),
                    "masks": masks.to(torch.uint8)[None], "protos": wire["protos"], "scores": wire["scores"]}
        write = unpack_bits(wire, "write", U)
        return {"values": dense_values(wire, "values", write[self.unit]), "write": write.to(torch.uint8)[None]}

    def integrate(self, w: torch.Tensor, payload: dict) -> torch.Tensor:
        """Alg. 1 line 13: the client's rows w [n, P] with U_k written where it has entries."""
        write = payload["write"].to(torch.bool).cpu()[:, self.unit]
        return torch.where(write.to(w.device), payload["values"].to(w.device, w.dtype), w)

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, self.updates_for(state, clients))

    # -- client ---------------------------------------------------------------------------------------------
    def _check_model(self, trainer, w: torch.Tensor, x: torch.Tensor) -> None:
        if self._checked or not len(x):
            return
        ref = trainer.logits(w[None].to(trainer.device), x[:8].to(trainer.device))[0].double().cpu()
        mine = lrp.forward([(a.double(), b.double()) for a, b in self.layout.layers(w.cpu())], x[:8].cpu().double())[-1]
        if not torch.allclose(ref, mine, atol=1e-4, rtol=1e-4):
            raise ConfigError("model", "not a ReLU MLP", "a ReLU MLP (Linear layers and ReLU, no normalisation): "
                              "FedSub's forward pass over the flat vector does not give the model's logits")
        self._checked = True

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        S, C = plan.clients, self.ctx.num_classes
        w = self.integrate(cstate["w"], plan.payload)
        t = trainer.train(TrainJob(S, w), rnd)
        if self.hp["prototypes"] == "input":
            protos = self.input_prototypes(trainer, S, cstate, rnd)
        else:
            protos, _ = local_prototypes(trainer, S, t.params, C, self.ctx, rnd)      # Eq. 1 (DP when asked)
        masks, scores, sent = [], [], []
        for i, c in enumerate(S):
            x, y = trainer.data(int(c), "train")
            self._check_model(trainer, t.params[i], x)
            m, counts, acc = class_subnetworks(self.layout, t.params[i], x, y, C, self.hp["subnetwork"],
                                               self.hp["lrp_eps"])
            masks.append(m.to(torch.uint8))
            scores.append(reliability(self.hp["reliability"], counts, acc))
            keep = m.any(0)[self.unit].to(t.params.device)                # nothing outside a subnetwork leaves
            sent.append(torch.where(keep, t.params[i], torch.zeros((), dtype=t.params.dtype, device=t.params.device)))
        payload = {"params": torch.stack(sent), "masks": torch.stack(masks), "protos": protos,
                   "scores": torch.stack(scores)}
        kept = {"w": t.params}
        if self.hp["prototypes"] == "input":
            kept.update(pin=cstate["pin"], pkey=cstate["pkey"])
        return Update(S, payload, t.n_samples, {"train_loss": t.loss}, client_state=kept)

    def input_prototypes(self, trainer, clients: np.ndarray, cstate: dict, rnd: int) -> torch.Tensor:
        """Eq. 1 with f the identity on the flattened input: [n, C, D] class means, from `cstate` while the
        client's train split is the one they were made from (signature: size, sum of inputs, sum of labels),
        else computed again and kept (`cstate` rows updated in place). `privacy.epsilon`: clipped rows and
        the Gaussian release of `fedprism.privacy`, once per data state."""
        from fedprism.privacy import clip_rows

        C, privacy = self.ctx.num_classes, getattr(self.ctx, "privacy", None)
        for i, c in enumerate(clients):
            x, y = trainer.data(int(c), "train")
            z = x.reshape(len(x), -1).to(torch.float64).cpu()
            y = y.cpu()
            key = torch.tensor([float(len(y)), float(z.sum()), float(y.sum())], dtype=torch.float64)
            if torch.equal(cstate["pkey"][i], key):
                continue
            if privacy is not None:
                z = clip_rows(z, privacy.clip)
            sums = torch.zeros(C, z.shape[1], dtype=torch.float64).index_add_(0, y, z)
            n = torch.bincount(y, minlength=C).to(torch.float64)
            if privacy is not None:
                p, _ = privacy.prototype_sums(sums, n, privacy.generator(self.ctx.seed, rnd, int(c), "prototypes"))
            else:
                p = sums / n.clamp(min=1)[:, None]
            cstate["pin"][i] = p.to(cstate["pin"].dtype)
            cstate["pkey"][i] = key
        return cstate["pin"].clone()

    # -- server ---------------------------------------------------------------------------------------------
    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        S = torch.as_tensor(update.clients)
        for k in ("params", "masks", "protos", "scores"):
            state[k][S] = update.payload[k].to(state[k].dtype)
        state["made"][S] = rnd
        cached = state["made"] >= 0
        holds = state["masks"].to(torch.bool).any(-1) & cached[:, None]          # [N, C]
        state["assign"].fill_(-1)
        ks = {}
        for c in range(self.ctx.num_classes):
            members = torch.nonzero(holds[:, c]).flatten()
            if not len(members):
                continue
            seed = int(np.random.SeedSequence([self.ctx.seed, rnd, c]).generate_state(1)[0])
            labels, _ = cluster_class(state["protos"][members, c].double().numpy(), seed)
            state["assign"][c, members] = torch.as_tensor(labels)
            ks[c] = int(labels.max()) + 1
        sizes = [subnetwork_bytes(m, self.layout) for m in update.payload["masks"]]
        return {"fedsub": {"k": ks, "oldest_artifact": int(state["made"][cached].min()),
                           "subnet_bytes_separate": sum(s["separate"] for s in sizes),
                           "subnet_bytes_union": sum(s["union"] for s in sizes),
                           "full_model_bytes": sum(s["full_model"] for s in sizes)}}

    # -- evaluation -----------------------------------------------------------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return self.updates_for(state, clients)

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"model": self.integrate(cstate["w"], payload)})
