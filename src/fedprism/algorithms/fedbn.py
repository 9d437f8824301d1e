"""FedBN (Li, Jiang, Zhang, Kamp, Dou 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", arXiv:2102.07623, Algorithm 1): FedAvg on every parameter except the BatchNorm layers',
which each client keeps.

    client k (sampled in round t):  w_k <- E epochs of SGD from (server's non-BN layers, k's own BN layers)
                                    keep k's BN layers; upload the other layers
    server, every non-BN layer l:   w_l^{t+1} = sum_{k in S_t} (n_k / N_t) w_{k,l}
    inference of client k:          the server's non-BN layers with k's own BN layers

The BatchNorm slices come from the model (`ParamSpec.batchnorm`), never from parameter names; on a model
without BatchNorm FedBN is FedAvg bit for bit (tested). `lenet5_bn` and `mlp_bn` are LeNet-5 and the
MLP with BatchNorm after each convolution and hidden linear layer, the layout of FedBN's digits model.
(`fedprism.algorithms.partial` is the shared pattern: server state, payloads, client state, inference.)

Decision: BatchNorm statistics. FedBN keeps all of a BN layer local: its affine parameters and its
running mean and variance, and evaluates each client in eval mode, i.e. with running statistics
estimated on that client's training batches. On a model with running statistics
(`fedprism.models.RunningBatchNorm2d`: `resnet18`, `resnet20`, `resnet8`, `mobilenet_small`) this is
exactly what runs: the statistics are part of each BN layer's slice of the flat vector
(`ParamSpec.batchnorm`, docs/architecture.md, "BatchNorm and the flat vector"), so the client keeps
them with the layer's weight and bias, training updates them and evaluation normalises with them,
while FedAvg averages them (tested by hand in tests/test_running_stats.py). On the batch-statistics
models (`track_running_stats=False`: `lenet5_bn`, `mlp_bn`, `cnn`, `clustpsi_cifar_cnn`) the flat
vector holds only the affine weight and bias of each BN layer, and those are what FedBN keeps on the
client; evaluation normalises each evaluated chunk with its own statistics. Why that is close enough
for the per-client evaluation, and where it is not:
* Local accuracy: a client's local test split is scored in chunks of `eval_chunk` (500) samples, so a
  split of at most 500 samples is normalised with its own mean and variance. That split has the
  client's own distribution, so these are estimates of the same per-client feature statistics that
  FedBN's running averages estimate on the training split, from other samples (the test split
  itself: transductive, and noisy for small splits; a split of one sample is normalised to beta).
* Global accuracy (each client's model on the shared test set) normalises with the shared test set's
  statistics, not the client's: it is not the number FedBN's running statistics would give.
* FedAvg on the same BN model evaluates with local batch statistics too, so the failure FedBN corrects
  in the paper (averaged running statistics that match no client at test time) does not arise there:
  FedBN and FedAvg differ by the local affine parameters only, and the gap between them is no measure
  of the paper's. Use a running-statistics model to measure it.

Defaults (`fedbn.<name>`): `weighting` = samples (n_k / N_t, as FedAvg here). The authors' code
(med-air/FedBN, federated/fed_digits.py, `communication`) averages with weights 1/K, and its clients
hold equally many samples (federated/fed_office.py cuts every domain to the smallest one's size); on
the FedPrism protocol's equal-size clients both weightings are the same. Local
training is the experiment's (the FedPrism protocol: SGD lr 0.01, momentum 0.9, E = 10, B = 32;
the authors' digits runs use SGD lr 0.01, B = 32, 1 local epoch, all clients every round) on the
default 'train' stream, with a fresh optimiser state each round.
A client's BN layers start as the initial model's (weight 1, bias 0) and change only when it trains.
The whole vector of the client's last local model is its client state (only its BN coordinates are
read, see `partial`); no BN coordinate is in any payload or counted in bytes.
"""

from __future__ import annotations

import torch

from fedprism.algorithms.base import register
from fedprism.algorithms.partial import WEIGHTING, PartialSharing


@register
class FedBN(PartialSharing):
    name = "fedbn"
    paper = "Li, Jiang, Zhang, Kamp, Dou 2021, arXiv:2102.07623, Algorithm 1"
    params = {"weighting": WEIGHTING}

    def shared_mask(self) -> torch.Tensor:
        keep = torch.ones(self.ctx.spec.size, dtype=torch.bool)
        for s in self.ctx.spec.batchnorm:
            keep[s] = False
        return keep
