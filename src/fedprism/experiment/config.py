"""Experiment configuration: one flat namespace of keys plus dotted method / partition / data keys.

Keys come from a TOML file (tables are flattened: `[fedprism] k = 5` is `fedprism.k`; TOML cannot
hold both `partition = "x"` and `partition.alpha`, so write `partition = { name = "dirichlet",
alpha = 0.1 }` or quote the key, `"partition.alpha" = 0.1`) and from
`key=value` arguments (values parsed as TOML literals: `0.1`, `true`, `"x"` or a bare word).
Every key is validated; unknown keys, wrong types and out-of-range values raise `ConfigError`
naming the key, the value and what is allowed; an unknown key names the closest valid key
("did you mean fedprism.k?").
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedprism.errors import ConfigError
from fedprism.registry import suggest  # noqa: F401 - the did-you-mean of every key, here for callers
from fedprism.hparams import Param, Space
from fedprism.systems import SYSTEM_KEYS, check_system

_pos = lambda v: v > 0  # noqa: E731
_nonneg = lambda v: v >= 0  # noqa: E731

#: keys that feed a dataset's loader (a `DatasetSpec.config_keys` entry): refused for a dataset that
#: does not read them
DATASET_KEYS = ("data.synthetic_devices", "data.hf.image", "data.hf.features", "data.hf.label", "data.hf.train_split",
                "data.hf.test_split", "data.hf.test_fraction")

#: keys of the datasets whose loaders take options: ACS PUMS states and year, the Digits domains and their
#: sizes, the Office-Caltech10 image side (each spec's `config_keys` names the ones it reads)
DATASET_KEYS = DATASET_KEYS + ("data.acs.states", "data.acs.year", "data.domains", "data.per_domain_train",
                               "data.per_domain_test", "data.image_size")
#: the EMNIST split
DATASET_KEYS = DATASET_KEYS + ("data.emnist.split",)

#: experiment keys (not method- or partition-specific)
#: upper bound of `threads=`: a fixed number, so that a configuration valid on one machine is valid on
#: every machine (a sweep file travels); 256 is four times the cores of a 64-core machine, and more
#: intra-op threads than that only oversubscribe (torch crashed with 100000)
MAX_THREADS = 256

KEYS: dict[str, Param] = {
    "method": Param("fedprism", "algorithm (see `fedprism methods`)"),
    "name": Param("", "free-form label stored with the run (not part of its id)"),
    "dataset": Param("digits", "a registered dataset (`fedprism datasets` lists them; docs/datasets.md)"),
    "data.root": Param("", "directory to look for dataset files first", lambda v: "\0" not in v,
                       "a folder path (no NUL character)"),
    "data.download": Param(False, "download missing dataset files (network)"),
    "data.pad32": Param("auto", "pad 28x28 images to 32x32 (auto: when the model needs 32x32)",
                        choices=("auto", "true", "false", True, False)),
    "data.train_subset": Param(0, "use a seeded random subset of this many train samples (0 = all)", _nonneg,
                               "an integer >= 0"),
    "data.test_subset": Param(0, "use a seeded random subset of this many global test samples (0 = all)", _nonneg,
                              "an integer >= 0"),
    "data.val_fraction": Param(0.0, "fraction of each client's training rows held out as its validation split "
                               "(hyper-parameters are chosen on validation data, never on test data)",
                               lambda v: 0 <= v <= 0.5, "a number in [0, 0.5]", new=True),
    "data.unseen_clients": Param(0.0, "fraction of the clients held out of every cohort (seeded; never sampled, "
                                 "never trained): at each evaluation they receive what the method gives a "
                                 "newcomer (Algorithm.newcomer_inference) and are reported as unseen_local_acc, "
                                 "while local_acc and every other client metric average the seen clients only "
                                 "(the participation gap; 0 = off)", lambda v: 0 <= v < 1, "a number in [0, 1)",
                                 new=True),
    "data.synthetic_devices": Param(30, "dataset=synthetic: number of the generator's natural devices (FedProx's "
                                    "Synthetic(1, 1)); more devices, more samples (30: 4 308 train samples; 1000: "
                                    "about 286 000)", lambda v: 1 <= v <= 100_000, "an integer in [1, 100000]",
                                    new=True),
    "data.hf.image": Param("", "dataset=hf:NAME: the image column (an Image feature or arrays of one shape); "
                           "'' = the one Image column when there is one (docs/huggingface.md)",
                           lambda v: "\0" not in v, "a column name, or '' (auto)", new=True),
    "data.hf.features": Param("", "dataset=hf:NAME: the numeric feature columns of tabular data, comma-separated "
                              "('' = use data.hf.image)", lambda v: "\0" not in v,
                              "comma-separated column names, or ''", new=True),
    "data.hf.label": Param("label", "dataset=hf:NAME: the label column (a ClassLabel, integers or strings)",
                           lambda v: bool(v) and "\0" not in v, "a column name", new=True),
    "data.hf.train_split": Param("train", "dataset=hf:NAME: the split the clients' training rows come from",
                                 lambda v: bool(v) and "\0" not in v, "a split name", new=True),
    "data.hf.test_split": Param("test", "dataset=hf:NAME: the split of the test set ('' = carve "
                                "data.hf.test_fraction of the train split, seeded and stratified by label)",
                                lambda v: "\0" not in v, "a split name, or ''", new=True),
    "data.hf.test_fraction": Param(0.2, "dataset=hf:NAME with data.hf.test_split='': share of the train split "
                                   "held out as the test set", lambda v: 0 < v < 1, "a number in (0, 1)", new=True),
    "data.global_val": Param(0, "size of a global validation set carved from the training pool before "
                             "partitioning (0 = none)", _nonneg, "an integer >= 0", new=True),
    "data.local_test": Param("official", "where each client's local test rows come from: official (drawn from "
                             "the dataset's test split with the client's label mix) or split (a seeded, "
                             "stratified hold-out of `data.local_test_fraction` of the client's own rows; "
                             "the global test set stays the official one)", choices=("official", "split"),
                             new=True),
    "data.local_test_fraction": Param(0.2, "data.local_test=split: share of each client's rows held out as its "
                                      "local test split (Clust-PSI-PFL: 0.2, an 80/20 split)",
                                      lambda v: 0 < v < 1, "a number in (0, 1)", new=True),
    "data.acs.states": Param("all", "dataset=acsincome: the US states read, all (folktables' 50 states and "
                             "Puerto Rico) or comma-separated postal codes (CA,TX)",
                             lambda v: bool(v.strip()) and "\0" not in v, "all, or postal codes such as CA,TX",
                             new=True),
    "data.acs.year": Param(2018, "dataset=acsincome: the year of the ACS PUMS 1-Year person files",
                           lambda v: 2000 <= v <= 2100, "a year such as 2018", new=True),
    "data.domains": Param("all", "dataset=digit_domains: the Digits domains loaded, all or comma-separated "
                          "names of their datasets (docs/datasets.md)", lambda v: bool(v.strip()) and "\0" not in v,
                          "all, or comma-separated domain names", new=True),
    "data.per_domain_train": Param(7291, "dataset=digit_domains: training images drawn from each domain "
                                   "(seeded; 0 = all)", _nonneg, "an integer >= 0", new=True),
    "data.per_domain_test": Param(2007, "dataset=digit_domains: test images drawn from each domain (seeded; "
                                  "0 = all)", _nonneg, "an integer >= 0", new=True),
    "data.image_size": Param(64, "dataset=office_caltech10: the side images are resized to",
                             lambda v: 8 <= v <= 1024, "an integer in [8, 1024]", new=True),
    "data.emnist.split": Param("byclass", "dataset=emnist: the split read (byclass 62 classes, bymerge and "
                               "balanced 47, letters 26, digits and mnist 10; docs/datasets.md)",
                               lambda v: bool(v) and "\0" not in v,
                               "byclass, bymerge, balanced, letters, digits or mnist", new=True),
    "model": Param("auto", "a registered model (`fedprism models` lists them, with the inputs each takes), or "
                   "auto (lenet5 for images >= 28px, else mlp)"),
    "partition": Param("dirichlet", "how the data is split across clients: a registered partition (`fedprism "
                       "partitions` lists them with their partition.* keys)"),
    "clients": Param(100, "number of clients N", _pos, "an integer >= 1"),
    "rounds": Param(100, "communication rounds T", _pos, "an integer >= 1"),
    "fraction": Param(0.1, "client sampling rate R per round", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "local_epochs": Param(10, "local epochs E", _nonneg, "an integer >= 0"),
    "batch_size": Param(32, "local batch size B", _pos, "an integer >= 1"),
    "lr": Param(0.01, "client SGD learning rate", lambda v: v > 0 and math.isfinite(v), "a finite number > 0",
                space=Space(0.001, 0.3, "log")),
    "momentum": Param(0.9, "client SGD momentum", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": Param(0.0, "client SGD weight decay", _nonneg, "a number >= 0"),
    "seed": Param(0, "run seed (partition, init, sampling, shuffling)", _nonneg, "an integer >= 0"),
    "eval_every": Param(1, "evaluate every this many rounds (and at the end)", _pos, "an integer >= 1"),
    "eval.global": Param(True, "score every client's model on the full global test set"),
    "eval.clients": Param(0, "clients scored per evaluation round, drawn seeded per round (0 = every client); the "
                          "final round always scores every client; sampled rounds are marked by the round metric "
                          "`eval_clients` and an `eval_sample` record", _nonneg, "an integer >= 0 (0: every client)",
                          new=True),
    "eval.finetune": Param(0, "local epochs of fine-tuning, at evaluation, from the model each client "
                           "predicts with (Algorithm.finetune_start), with the run's local optimiser settings, "
                           "on the client's training rows; scored beside the headline as the alternative "
                           "prediction `ft` (local_acc@ft, global_acc@ft); 0 = off. Evaluation-only: a finished "
                           "run with a kept final state is re-scored without training", _nonneg,
                           "an integer >= 0 (0: off)", new=True, eval_only=True),
    "eval.precision": Param("float32", "precision of every evaluation forward pass: float32, or bfloat16 "
                            "(weights and inputs cast; faster on CPUs with native bf16 such as AVX512-BF16, "
                            "numbers change slightly: bench/README.md). Training: train.precision",
                            choices=("float32", "bfloat16"), new=True),
    "train.precision": Param("float32", "precision of local training's forward and backward passes: float32 (the "
                             "stored runs' numbers) or bfloat16 (mixed precision: the objective under "
                             "torch.autocast(device, bfloat16), so convolutions and matrix products compute in "
                             "bf16 while parameters, optimiser state and every vector the server sees stay "
                             "float32; faster on CPUs with native bf16 such as AVX512-BF16 and on GPUs, numbers "
                             "change: bench/README.md). Trains through PyTorch's kernels (train.kernels=aten)",
                             choices=("float32", "bfloat16"), new=True),
    "eval.kernels": Param("auto", "kernels of every evaluation forward pass on a CPU: auto (fused where the "
                          "kernels are built for this machine and the run is on a CPU, else aten; "
                          "fedprism.kernels), aten (PyTorch's, the stored runs' numbers), fused (each conv -> "
                          "ReLU -> 2x2 max-pooling block of the model in one C++ kernel, `fedprism kernels "
                          "build`; logits change at float32 rounding: bench/README.md). Resolved to the "
                          "kernels that run before the run id is computed. Training: train.kernels",
                          choices=("auto", "aten", "fused"), new=True),
    "train.kernels": Param("auto", "kernels of local training on a CPU: auto (fused where the kernels are built "
                           "for this machine and the run is on a CPU, else aten; fedprism.kernels), aten "
                           "(PyTorch's, the stored runs' numbers) or fused (the model's first two conv -> ReLU "
                           "-> 2x2 max-pooling blocks through the fused kernels' forwards and backwards; "
                           "numbers change at float32 rounding: bench/README.md). Resolved to the kernels that "
                           "run before the run id is computed", choices=("auto", "aten", "fused"), new=True),
    "eval.gate": Param("none", "a learned routing gate between a dual-stream method's specialist and "
                       "backbone (learned: fitted on the validation splits at the final evaluation, one "
                       "candidate routing per weight, `gate w=..`; the method's learned_gate); "
                       "evaluation-only: a finished run with a kept final state is re-scored without "
                       "training",
                       choices=("none", "learned"), new=True, eval_only=True),
    "state.storage": Param("memory", "where the clients' own state (private models, specialists, local models) is "
                           "kept: memory (RAM, bit for bit the stored runs), float16 (RAM at half precision: "
                           "numbers change) or mmap (rows in files beside the checkpoint, RAM holds only the rows "
                           "in use: same numbers as memory)", choices=("memory", "float16", "mmap"), new=True),
    "device": Param("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"),
                    allowed="for GPU N of several, run with CUDA_VISIBLE_DEVICES=N and device=cuda"),
    "engine": Param("auto", "auto, sequential or vectorized", choices=("auto", "sequential", "vectorized")),
    "compile": Param("auto", "torch.compile the vectorized kernels (auto: on for long runs)",
                     choices=("auto", "true", "false", True, False)),
    "fuse_jobs": Param("auto", "the vectorized engine runs a round's independent trainings (fedprism_dual's "
                       "specialists and private parts) as one pass; auto: on CUDA only (bench/README.md, GPU); "
                       "numbers change at rounding level only; not part of the run id",
                       choices=("auto", "true", "false", True, False), new=True),
    "cuda_graphs": Param("auto", "the vectorized engine replays each training step from a CUDA graph (one "
                         "launch per step; the same bits); auto: on for compiled CUDA runs; true needs CUDA; "
                         "not part of the run id", choices=("auto", "true", "false", True, False), new=True),
    "threads": Param(0, "torch intra-op threads for the run (0: leave torch's default); recorded with the "
                     "run, not part of its id", lambda v: 0 <= v <= MAX_THREADS,
                     f"an integer in [0, {MAX_THREADS}] (0: torch's default; a fixed bound, the same on every "
                     "machine: more threads than cores only oversubscribe them)"),
    "scalars": Param("", "directory for per-round and per-client scalars as CSV, written as each round is "
                     "stored ('' = none; not part of the run id)"),
    "optimizer": Param("sgd", "client optimiser: sgd (lr, momentum, weight_decay) or adam (lr, weight_decay; "
                       "betas 0.9/0.999, eps 1e-8)", choices=("sgd", "adam"), new=True),
    "selection": Param("uniform", "client selection each round: uniform (seeded uniform draw), poc "
                       "(Power-of-Choice), haccs (label-histogram groups, low latency first), fedcls (label "
                       "diversity by Hamming distance); fedprism.selection",
                       choices=("uniform", "poc", "haccs", "fedcls"), new=True),
    "selection.d": Param(0, "Power-of-Choice candidate set size d, m_t <= d <= clients (0: min(clients, "
                         "2 m_t))", _nonneg, "an integer >= 0", new=True),
    "selection.rho": Param(0.95, "HACCS: probability of picking a group's fastest client", lambda v: 0 <= v <= 1,
                           "a number in [0, 1]", new=True),
    "selection.tau": Param(0.1, "FedCLS: a class is present at a client when its count is at least tau x the "
                           "client's largest class count", lambda v: 0 < v <= 1, "a number in (0, 1]", new=True),
    "privacy.epsilon": Param(0.0, "(epsilon, delta)-DP per client for the statistics clients share (label "
                             "counts; class prototypes): Gaussian noise calibrated by an RDP accountant "
                             "(fedprism.privacy); 0 = exact statistics", lambda v: v >= 0 and math.isfinite(v),
                             "a finite number >= 0 (0: off)", new=True),
    "privacy.delta": Param(1e-5, "delta of the privacy budget", lambda v: 0 < v < 1, "a number in (0, 1)", new=True),
    "privacy.clip": Param(1.0, "L2 bound on each sample's feature vector before class prototypes are summed",
                          lambda v: v > 0 and math.isfinite(v), "a finite number > 0", new=True),
    "privacy.noise": Param("seeded", "where the privacy noise comes from: seeded (a stream of the run seed: "
                           "reproducible simulations) or system (OS entropy: deployments, where the server "
                           "knows the seed)", choices=("seeded", "system"), new=True),
    "dp.clip": Param(0.0, "DP-FedAvg (client-level DP for model updates, docs/privacy.md): each client's update is "
                     "clipped to this L2 norm C and the server adds N(0, (z C)^2) to their sum; for every method "
                     "that averages models; 0 = off", lambda v: v >= 0 and math.isfinite(v),
                     "a finite number >= 0 (0: off)", new=True),
    "dp.noise_multiplier": Param(1.0, "DP-FedAvg: z, the noise's standard deviation in units of dp.clip (0: "
                                 "clipping without noise, epsilon infinite)", lambda v: v >= 0 and math.isfinite(v),
                                 "a finite number >= 0", new=True),
    "dp.target_delta": Param(1e-5, "DP-FedAvg: the delta at which the epsilon spent is reported",
                             lambda v: 0 < v < 1, "a number in (0, 1)", new=True),
    "dp.accountant": Param("rdp", "DP-FedAvg: dp-accounting's accountant of the epsilon spent: rdp (Renyi DP) or "
                           "pld (privacy loss distributions; tighter, slower)", choices=("rdp", "pld"), new=True),
    "dp.sampling": Param("poisson", "DP-FedAvg: the client sampling the accountant assumes: poisson (each client "
                         "with probability q = cohort / clients) or fixed (the cohort drawn without replacement, "
                         "replace-one adjacency; rdp only)", choices=("poisson", "fixed"), new=True),
    "dp.local": Param("none", "local DP-SGD through Opacus (fedprism.local_dp, docs/privacy.md): every local "
                      "training of fedavg, fedprox, local or ditto clips each sample's gradient to dp.local_clip and "
                      "adds Gaussian noise; none = off", choices=("none", "dpsgd"), new=True),
    "dp.local_clip": Param(1.0, "dp.local=dpsgd: C, the L2 bound on each sample's gradient",
                           lambda v: v > 0 and math.isfinite(v), "a finite number > 0", new=True),
    "dp.local_noise": Param(1.0, "dp.local=dpsgd: z, the noise's standard deviation on the sum of the clipped "
                            "per-sample gradients in units of dp.local_clip (0: clipping only, epsilon infinite)",
                            lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0", new=True),
    "dp.local_delta": Param(1e-5, "dp.local=dpsgd: the delta at which each client's epsilon is reported",
                            lambda v: 0 < v < 1, "a number in (0, 1)", new=True),
    "compress": Param("none", "compression of what clients upload (fedprism.compression): int8 (8-bit, one scale "
                      "per tensor), stochastic (QSGD with compress.bits bits) or topk (the compress.k largest "
                      "entries, error feedback on); every method; none = off",
                      choices=("none", "int8", "stochastic", "topk"), new=True),
    "compress.k": Param(0.01, "compress=topk: the fraction of each uploaded tensor's entries sent",
                        lambda v: 0 < v <= 1, "a number in (0, 1]", new=True),
    "compress.bits": Param(4, "compress=stochastic: bits per entry (2^(bits-1) - 1 levels per sign)",
                           lambda v: 2 <= v <= 8, "an integer in [2, 8]", new=True),
    "compress.feedback": Param("auto", "error feedback (the client keeps what compression dropped and adds it to "
                               "its next update): auto (on for topk only), true or false",
                               choices=("auto", "true", "false", True, False), new=True),
    "attack.fraction": Param(0.0, "Byzantine clients (fedprism.attacks): the fraction of the clients, drawn once "
                             "from the run seed, whose model upload is replaced by a crafted one every time they "
                             "are sampled, for studying the robust rules (<method>.aggregation); 0 = off",
                             lambda v: 0 <= v < 1, "a number in [0, 1)", new=True),
    "attack.kind": Param("sign_flip", "attack.fraction > 0: what a Byzantine client uploads: sign_flip (its update "
                         "reversed, x scale) or gaussian (the model it was sent + scale x N(0, I) noise)",
                         choices=("sign_flip", "gaussian"), new=True),
    "attack.scale": Param(1.0, "attack.fraction > 0: lambda, the reversed update's scale (sign_flip) or the noise's "
                          "standard deviation (gaussian)", lambda v: v > 0, "a number > 0", new=True),
    "drift.fraction": Param(0.0, "dynamic data: fraction of the clients whose classes leave and come back "
                            "(fedprism.data.drift; 0 = static data)", lambda v: 0 <= v <= 1, "a number in [0, 1]",
                            new=True),
    "drift.remove": Param(0.8, "dynamic data: share of a drifting client's classes removed before round 0",
                          lambda v: 0 <= v <= 1, "a number in [0, 1]", new=True),
    "drift.every": Param(50, "dynamic data: rounds between two returns (one class per drifting client each time)",
                         _pos, "an integer >= 1", new=True),
    "keep_final": Param(True, "keep the final server and client state beside the store (re-scoring of "
                        "evaluation-only settings without training)"),
    "fail_on_client_error": Param(False, "true: a client that fails (its client_update raises, or a Flower "
                                  "node's error reply or timeout) fails the run with its message, instead of "
                                  "being recorded while the round goes on without it; changes outcomes only by "
                                  "failing, so not part of the run id"),
    "checkpoint.key": Param("", "path of a key file (at least 32 bytes): checkpoints and kept final states are "
                            "signed with HMAC-SHA256 under it instead of a plain SHA-256, so a file edited by "
                            "someone without the key is discarded (for stores that others can write to; "
                            "docs/robustness.md); '' = no key; not part of the run id",
                            lambda v: "\0" not in v, "a path to a key file, or '' (no NUL character)"),
    **SYSTEM_KEYS,          # availability, speeds, deadlines, FedBuff (fedprism.systems, docs/systems.md)
}

#: parameters every partition takes (minimum samples per client)
PARTITION_COMMON: dict[str, Param] = {
    "min_train": Param(10, "minimum train samples per client", _pos, "an integer >= 1"),
    "min_test": Param(1, "minimum local test samples per client", _nonneg, "an integer >= 0"),
}

#: the kernel keys: resolved to the kernels that run on this machine before the run id is computed
#: (`fedprism.kernels.resolve`; `auto` never reaches the identity)
KERNEL_KEYS = ("train.kernels", "eval.kernels")
#: keys whose default changed after runs were stored: left out of the run id while they hold the value those
#: runs had by default (every run before the kernels was `aten`, and hashes as it did)
LEGACY_DEFAULTS = {"train.kernels": "aten", "eval.kernels": "aten"}

#: partition keys added after runs were stored (a partition's `Param.new`), left out of the run id while they
#: hold these values: the partition's declaration is not imported to hash a configuration (a stored-result
#: lookup imports no partition module)
NEW_PARTITION_KEYS = {"partition.column": "", "partition.min_keep": 1.0}

#: keys that change how a run executes but not its numbers (excluded from the run id)
EXECUTION_KEYS = frozenset({"name", "device", "engine", "compile", "fuse_jobs", "cuda_graphs", "data.root",
                            "data.download", "keep_final", "threads", "scalars", "checkpoint.key",
                            "fail_on_client_error"})


def parse_value(text: str) -> Any:
    """A command-line value: a TOML literal if it parses, else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    doc = read_toml(path, "config file")
    if isinstance(doc.get("runs"), list) or any(isinstance(doc.get(t), dict) for t in ("grid", "base")):
        raise ConfigError("config file", str(path), "one run's keys; this is a sweep file ([base], [grid] or "
                          f"[[runs]]): run it with `fedprism sweep {path}`")
    return flatten(doc)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; every way it can fail (missing, unreadable, not UTF-8, not TOML) is a
    one-line ConfigError naming the file. A UTF-8 byte-order mark at its start (Windows editors write
    one) is skipped; TOML itself does not allow it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(what, str(p), "an existing TOML file", kind="")
    bom = 0
    try:
        data = p.read_bytes()
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        text = data[bom:].decode("utf-8")
    except OSError as e:
        raise ConfigError(what, str(p), f"a readable TOML file ({e.strerror or e})", kind="") from None
    except UnicodeDecodeError as e:
        raise ConfigError(what, str(p), f"UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {bom + e.start} "
                          "is not UTF-8)", kind="") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(what, str(p), f"valid TOML ({e})", kind="") from None
    except RecursionError:
        raise ConfigError(what, str(p), "valid TOML (nested too deeply)", kind="") from None


def parse_overrides(args: list[str]) -> dict[str, Any]:
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError("argument", a, "key=value (e.g. rounds=20 fedprism.k=5)", kind="")
        k, v = a.split("=", 1)
        out[k.strip()] = parse_value(v.strip())     # a key given again overrides (`BASE... rounds=1`)
    return out


@dataclass(frozen=True)
class Config:
    """A resolved, validated configuration. `values` holds every key with its final value; `auto` names the
    kernel keys that were `auto` before resolution (`prefer_stored` may choose another value for them).
    `declared`: the method's parameters as the run id reads them (`Param.new`, `Param.eval_only`, defaults),
    for a configuration rebuilt without importing its method (fedprism.experiment.lookup); None: read from
    the method's registration."""

    values: dict[str, Any]
    auto: frozenset = field(default=frozenset(), compare=False)
    declared: dict[str, Param] | None = field(default=None, compare=False, repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def method_params(self) -> dict[str, Any]:
        p = f"{self['method']}."
        return {k[len(p):]: v for k, v in self.values.items() if k.startswith(p)}

    @property
    def partition_params(self) -> dict[str, Any]:
        return {k[len("partition."):]: v for k, v in self.values.items() if k.startswith("partition.")}

    def _params(self) -> dict[str, Param]:
        if self.declared is not None:
            return {**KEYS, **{f"{self['method']}.{k}": p for k, p in self.declared.items()}}
        from fedprism.algorithms import REGISTRY

        method = REGISTRY.find(self["method"])
        mp = {f"{self['method']}.{k}": p for k, p in (method.params if method else {}).items()}
        return {**KEYS, **mp}

    @property
    def identity(self) -> dict[str, Any]:
        """What identifies the run: every key except execution-only ones, and except keys added after
        runs were first stored (`Param.new`) while they hold their default, so stored run ids stay valid."""
        params = self._params()
        return {k: v for k, v in sorted(self.values.items())
                if k not in EXECUTION_KEYS and not (k in params and params[k].new
                                                    and v == LEGACY_DEFAULTS.get(k, params[k].default))
                and not (k in NEW_PARTITION_KEYS and v == NEW_PARTITION_KEYS[k])}

    @property
    def run_id(self) -> str:
        """Hash of the resolved config (seed included); execution-only keys excluded."""
        blob = json.dumps(self.identity, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def train_identity(self) -> dict[str, Any]:
        """What training depends on: the identity without evaluation-only method parameters (`Param.eval_only`)."""
        params = self._params()
        return {k: v for k, v in self.identity.items() if not (k in params and params[k].eval_only)}

    @property
    def train_id(self) -> str:
        """Hash of what training depends on (`train_identity`). Runs that differ only in evaluation-only
        parameters train the same models."""
        return hashlib.sha256(json.dumps(self.train_identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def with_(self, **kw: Any) -> "Config":
        kw = {k.replace("__", "."): v for k, v in kw.items()}
        return resolve({**self.values, **{k: "auto" for k in self.auto if k not in kw}, **kw})


def resolve_stored(values: dict[str, Any]) -> Config:
    """Resolve a configuration as a store holds it (`runs.config`): a key of `LEGACY_DEFAULTS` that the stored
    configuration does not hold takes the value every run had before the key existed, not today's default.
    A run stored before the kernels existed is replayed (`verify`, `run --fresh RUN_ID`) with PyTorch's
    kernels, as it ran, and resolves to its own id."""
    return resolve({**{k: v for k, v in LEGACY_DEFAULTS.items() if k not in values}, **values})


def prefer_stored(cfg: Config, store: Any) -> Config:
    """`cfg`, or the same run with PyTorch's kernels where its kernels were `auto`, resolved to the fused ones,
    and `store` holds that run but not this one: asking with `auto` for a run that is stored with the
    kernels every run had before them (e.g. a committed run) finds that run instead of starting a fused one
    (docs/reproducibility.md). An explicit `fused` or `aten` is never changed."""
    fast = sorted(k for k in cfg.auto if cfg.values.get(k) != "aten")
    if not fast or store.run(cfg.run_id) is not None:
        return cfg
    alt = Config({**cfg.values, **{k: "aten" for k in fast}}, cfg.auto, cfg.declared)
    return alt if store.run(alt.run_id) is not None else cfg


def resolve(raw: dict[str, Any]) -> Config:
    """Validate `raw` (flat keys) and fill defaults for the experiment, the method and the partition."""
    from fedprism import plugins
    from fedprism.algorithms import REGISTRY
    from fedprism.data.partitions import PARTITIONS

    plugins.load()
    raw = dict(raw)
    if "partition.name" in raw:        # TOML: [partition] name = "dirichlet", alpha = 0.1
        raw["partition"] = raw.pop("partition.name")
    for k in ("method", "partition", "dataset"):
        if k in raw and not isinstance(raw[k], str):
            raise ConfigError(k, raw[k], "a name (string); see `fedprism methods`")
    method = raw.get("method", KEYS["method"].default)
    if method not in REGISTRY:                   # the one registry error: choices, nearest, plugin hint
        raise REGISTRY.not_found(method)
    part = raw.get("partition", KEYS["partition"].default)
    if part not in PARTITIONS:
        raise PARTITIONS.not_found(part)
    from fedprism.data.base import DATASETS
    from fedprism.models import MODELS
    ds = raw.get("dataset", KEYS["dataset"].default)
    if ds not in DATASETS:
        raise DATASETS.not_found(ds)
    model = raw.get("model", KEYS["model"].default)
    if not isinstance(model, str) or (model != "auto" and model not in MODELS):
        raise MODELS.not_found(model, also=("auto",))

    out: dict[str, Any] = {}
    for k, p in KEYS.items():
        out[k] = p.validate(k, raw.pop(k)) if k in raw else p.default
    part_params = {**PARTITION_COMMON, **PARTITIONS[part].params}
    for k, p in part_params.items():
        key = f"partition.{k}"
        out[key] = p.validate(key, raw.pop(key)) if key in raw else p.default
    mp = {k[len(method) + 1:]: raw.pop(k) for k in list(raw) if k.startswith(method + ".")}
    for k in sorted(mp):
        if k not in REGISTRY[method].params:
            allowed = ", ".join(f"{method}.{p}" for p in REGISTRY[method].params) or "none"
            hint = suggest(f"{method}.{k}", [f"{method}.{p}" for p in REGISTRY[method].params])
            raise ConfigError(f"{method}.{k}", mp[k], f"unknown parameter{hint}; {method} takes {allowed}")
    for k, v in REGISTRY[method].resolve(mp).items():
        out[f"{method}.{k}"] = v
    if raw:
        k = sorted(raw)[0]
        valid = [*KEYS, *(f"partition.{p}" for p in part_params),
                 *(f"{m}.{p}" for m, cls in REGISTRY.items() for p in cls.params)]
        hint = suggest(k, valid)
        if k.startswith("partition."):
            owners = [n for n, spec in PARTITIONS.items() if k.split(".", 1)[1] in spec.params]
            hint = f" (a key of partition={' / '.join(owners)})" if owners else \
                suggest(k, [f"partition.{p}" for p in part_params])
            allowed = ", ".join(f"partition.{p}" for p in part_params)
            raise ConfigError(k, raw[k], f"unknown key for partition={part}{hint}; it takes {allowed}")
        other = k.split(".")[0]
        if other in REGISTRY and "." not in k:     # a TOML [[fedavg]]: an array of tables, not a table
            raise ConfigError(k, raw[k], f"a [{other}] table of {other}.KEY = value parameters (a TOML "
                              f"[[{other}]] is an array of tables)")
        if other in REGISTRY:
            article = "an" if other[:1] in "aeiou" else "a"
            raise ConfigError(k, raw[k], f"{article} {other} parameter, but method={method}")
        if hint:                            # the nearest key is the answer; the whole list would bury it
            raise ConfigError(k, raw[k], f"unknown key{hint}; `fedprism methods` lists every key")
        raise ConfigError(k, raw[k], f"unknown key{hint}; known keys: {', '.join(KEYS)} and {method}.*, "
                                     "partition.*")
    if out["eval.clients"] > out["clients"]:
        raise ConfigError("eval.clients", out["eval.clients"], f"an integer in [0, clients={out['clients']}] "
                          "(0: every client)")
    if out["eval.gate"] != "none":
        _check_gate(out)
    check_system(out)
    if out["data.unseen_clients"] > 0:
        held = held_out_count(out["clients"], out["data.unseen_clients"])
        if not 1 <= held < out["clients"]:
            raise ConfigError("data.unseen_clients", out["data.unseen_clients"], "0 (off) or a fraction that holds "
                              f"out at least one of the {out['clients']} clients and leaves at least one to "
                              f"train (floor(fraction x clients) in [1, {out['clients'] - 1}]; it gives {held})")
    _check_uplink(out, REGISTRY[method])
    for key in DATASET_KEYS:            # a dataset's own key, given for a dataset that does not read it
        if out[key] != KEYS[key].default and key not in dict(DATASETS.get(out["dataset"]).config_keys):
            takers = [n for n, spec in DATASETS.all().items() if key in dict(spec.config_keys)]
            takers += [f"{p}:NAME" for p in DATASETS.families() if key in dict(DATASETS.get(f"{p}:NAME").config_keys)]
            raise ConfigError(key, out[key], f"only with dataset={' or '.join(takers)} "
                              f"(dataset={out['dataset']}); leave it out")
    from fedprism import kernels         # last: a configuration refused above builds nothing
    auto = frozenset(k for k in KERNEL_KEYS if out[k] == "auto")
    if "train.kernels" in auto and not getattr(REGISTRY[method], "fused_training", True):
        out["train.kernels"] = "aten"      # an objective the fused training kernels cannot take (APFL, ...)
    if out["train.precision"] == "bfloat16":
        if out["train.kernels"] == "fused":
            raise ConfigError("train.kernels", "fused", "aten or auto with train.precision=bfloat16 (the fused "
                              "training kernels compute in float32; bf16 training runs PyTorch's kernels)")
        out["train.kernels"] = "aten"      # auto: the fused kernels are float32 only
        if out["dp.local"] != "none":
            raise ConfigError("train.precision", "bfloat16", f"float32 with dp.local={out['dp.local']} (Opacus' "
                              "per-sample gradients are computed in float32; bf16 training is not applied there)")
    if auto and not _has_conv_blocks(out["model"], DATASETS.get(out["dataset"]).input_shape):
        out.update({k: "aten" for k in auto})   # nothing to fuse (an MLP): the kernels that run are PyTorch's
    for k in KERNEL_KEYS:                  # what runs, not what was asked: it is part of the run id
        out[k] = kernels.resolve(k, out[k], out["device"])
    return Config(out, auto)


def _check_uplink(out: dict, cls) -> None:
    """DP-FedAvg (`dp.clip`) and compression (`compress`) against the method."""
    from fedprism.algorithms.base import Algorithm

    m = out["method"]
    if out["dp.clip"] > 0:
        if not cls.averages:
            raise ConfigError("dp.clip", out["dp.clip"], f"0 for method={m}: it averages no models through the "
                              "shared server step (Algorithm.averages), so there is no sum of updates to clip and "
                              "noise")
        if out.get(f"{m}.aggregation", "mean") != "mean":
            raise ConfigError("dp.clip", out["dp.clip"], f"0 with {m}.aggregation={out[f'{m}.aggregation']}: "
                              "DP-FedAvg's sensitivity bound holds for the clipped sum (aggregation=mean)")
        if out["dp.sampling"] == "fixed" and out["dp.accountant"] == "pld":
            raise ConfigError("dp.sampling", "fixed", "poisson with dp.accountant=pld (the PLD accountant has no "
                              "sampling without replacement; use dp.accountant=rdp)")
    from fedprism.local_dp import check_config as _check_local_dp
    _check_local_dp(out)                 # dp.local=dpsgd: the methods and the engine it takes
    if out["compress"] != "none" and cls.encode is not Algorithm.encode:
        raise ConfigError("compress", out["compress"], f"none for method={m}: its upload has its own encoding "
                          f"({cls.__name__}.encode)")


def _has_conv_blocks(model: str, input_shape: tuple[int, ...] | None) -> bool:
    """Whether the run's model may hold blocks the fused kernels run (`ModelSpec.conv`); `model=auto` is
    LeNet-5 for images of at least 28 pixels and an MLP otherwise (`resolve_model_name`). A dataset that does
    not declare its shape counts as one that may."""
    from fedprism.models import AUTO_IMAGES, AUTO_OTHER, MODELS

    if model == "auto":
        if input_shape is None:
            return True
        model = AUTO_IMAGES if len(input_shape) == 3 and input_shape[-1] >= 28 else AUTO_OTHER
    return MODELS.get(model, "model").conv


def held_out_count(clients: int, fraction: float) -> int:
    """`data.unseen_clients`: how many of `clients` are held out, floor(fraction x clients)."""
    return int(math.floor(fraction * clients + 1e-9))


def _check_gate(out: dict) -> None:
    """`eval.gate` needs a method with a learned gate over its streams (`Algorithm.learned_gate`), a
    configuration the gate can route (its `check_config`) and validation data to fit on."""
    from fedprism.algorithms import REGISTRY

    gate = REGISTRY[out["method"]].learned_gate()
    if gate is None:
        gated = [m for m in REGISTRY.names() if REGISTRY[m].learned_gate() is not None]
        raise ConfigError("eval.gate", out["eval.gate"], f"none for method={out['method']}: the gate chooses "
                          f"between a specialist and a backbone stream ({', '.join(gated)})")
    gate.check_config(out)
    for k in ("data.val_fraction", "data.global_val"):
        if not out[k] > 0:
            raise ConfigError("eval.gate", out["eval.gate"], f"none unless {k} > 0 (the gate is fitted on "
                              f"the clients' validation rows and the global validation set; {k}={out[k]})")


def describe_keys() -> list[tuple[str, Any, str]]:
    return [(k, p.default, p.help) for k, p in KEYS.items()]
