"""Config -> Federation: load the dataset, partition it, apply domain transforms (domain_mix)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from fedprism.experiment.config import DATASET_KEYS, Config
from fedprism.federation import Federation


def resolve_model_name(model: str, input_shape: tuple[int, ...], vocab_size: int = 0) -> str:
    """`auto`: a text CNN for token data (`vocab_size` > 0), LeNet-5 for images of at least 28 pixels, an
    MLP for everything else."""
    from fedprism.models import AUTO_IMAGES, AUTO_OTHER, AUTO_TOKENS

    if model != "auto":
        return model
    if vocab_size:
        return AUTO_TOKENS
    return AUTO_IMAGES if len(input_shape) == 3 and input_shape[-1] >= 28 else AUTO_OTHER


def dataset_vocab(dataset: str) -> int:
    """The vocabulary size a dataset's spec declares (0: not token data, or not declared)."""
    from fedprism.data.base import DATASETS

    spec = DATASETS.find(dataset)
    return int(getattr(spec, "vocab_size", 0) or 0) if spec is not None else 0


def _pad32(cfg: Config, dataset: str) -> bool:
    v = cfg["data.pad32"]
    if v in (True, "true"):
        return True
    if v in (False, "false"):
        return False
    from fedprism.data.base import DATASETS

    if not DATASETS.get(dataset).pad32_auto:
        return False
    from fedprism.models import AUTO_IMAGES, MODELS        # the model declares it (`ModelSpec.pad32`)

    return MODELS.get(AUTO_IMAGES if cfg["model"] == "auto" else cfg["model"], "model").pad32


@lru_cache(maxsize=4)
def _federation(dataset: str, root: str, download: bool, pad32: bool, partition: str,
                part_items: tuple, clients: int, seed: int, train_subset: int = 0, test_subset: int = 0,
                val_fraction: float = 0.0, global_val: int = 0, local_test: str = "official",
                local_test_fraction: float = 0.2, synthetic_devices: int = 30,
                dataset_options: tuple = ()) -> Federation:
    from fedprism.data.base import DATASETS, natural_datasets
    from fedprism.data.datasets import load_dataset
    from fedprism.data.partition import make_partition
    from fedprism.errors import ConfigError

    spec = DATASETS.get(dataset)
    options = spec.loader_kwargs({"data.synthetic_devices": synthetic_devices,    # the keys federation_key holds
                                  **dict(dataset_options)})
    ds = load_dataset(dataset, root=root or None, download=download, pad32=pad32, **options)
    x_tr, y_tr, x_te, y_te = ds.x_train, ds.y_train, ds.x_test, ds.y_test
    vocab = int(getattr(ds, "vocab_size", 0) or 0)       # token data keeps its int64 ids
    g_tr, g_te = getattr(ds, "groups", None), getattr(ds, "test_groups", None)   # natural clients, if any
    from fedprism.data.partitions import PARTITIONS

    by_groups = PARTITIONS.get(partition, "partition").natural      # the partition declares it
    column = dict(part_items).get("column", "")
    if by_groups and column:            # partition=natural on a named column of the data (`partition.column`)
        from fedprism.data.partitions.natural import column_groups

        g_tr, g_te = column_groups(getattr(ds, "columns", None), getattr(ds, "test_columns", None), column, dataset)
    if by_groups and (g_tr is None or g_te is None):
        raise ConfigError("partition", partition, f"a partition this dataset supports: '{partition}' gives each "
                          "client the samples of one user or device and needs a dataset that records them "
                          f"({', '.join(natural_datasets())}); dataset '{dataset}' does not")
    rng = np.random.default_rng([seed, 0xDA7A])
    for key, want, have in (("data.train_subset", train_subset, len(y_tr)), ("data.test_subset", test_subset,
                                                                            len(y_te))):
        if want > have:                 # "all of it" under another run id would hide a typo
            raise ConfigError(key, want, f"0 (all) or an integer <= the {have} samples of {dataset}'s "
                              f"{key.split('.')[1].split('_')[0]} split")
    if 0 < train_subset < len(y_tr):
        keep = torch.as_tensor(np.sort(rng.permutation(len(y_tr))[:train_subset]))
        x_tr, y_tr = x_tr[keep], y_tr[keep]
        g_tr = None if g_tr is None else np.asarray(g_tr)[keep.numpy()]
    if 0 < test_subset < len(y_te):
        keep = torch.as_tensor(np.sort(rng.permutation(len(y_te))[:test_subset]))
        x_te, y_te = x_te[keep], y_te[keep]
        g_te = None if g_te is None else np.asarray(g_te)[keep.numpy()]
    x_val = y_val = None
    if global_val > 0:              # carved from the training pool before partitioning (seeded)
        if global_val >= len(y_tr):
            raise ConfigError("data.global_val", global_val, f"an integer < the {len(y_tr)} training samples")
        perm = np.random.default_rng([seed, 0x6A1]).permutation(len(y_tr))
        gv, rest = torch.as_tensor(np.sort(perm[:global_val])), torch.as_tensor(np.sort(perm[global_val:]))
        x_val, y_val = _inputs(x_tr[gv], vocab), y_tr[gv].long()
        x_tr, y_tr = x_tr[rest], y_tr[rest]
        g_tr = None if g_tr is None else np.asarray(g_tr)[rest.numpy()]
    params = dict(part_items)
    if params.get("column") == "":      # `natural`'s column at its default: recorded as before the key existed
        del params["column"]
    natural = {"groups": g_tr, "test_groups": g_te} if by_groups else {}
    if partition == "domain_mix" and spec.natural == "domain" and g_tr is not None and g_te is not None:
        from fedprism.data.domains import real_domain_mix      # real domains: no transform (data/domains.py)
        part = real_domain_mix(y_tr.numpy(), y_te.numpy(), g_tr, g_te, clients, seed, params)
    else:
        part = make_partition(partition, y_tr.numpy(), y_te.numpy(), clients, seed, **params, **natural)
    train_idx, test_idx = list(part.train), list(part.test)
    if part.domains is not None:
        from fedprism.data.domains import apply_domain
        if vocab:
            raise ConfigError("partition", partition, f"a partition without domain transforms: '{partition}' "
                              f"transforms images, and dataset '{dataset}' is token data")
        doms = sorted(set(int(d) for d in part.domains))
        n_tr, n_te = len(y_tr), len(y_te)
        x_tr = torch.cat([torch.as_tensor(apply_domain(x_tr.numpy(), d, seed=seed)) for d in doms])
        x_te = torch.cat([torch.as_tensor(apply_domain(x_te.numpy(), d, seed=seed + 1)) for d in doms])
        y_tr, y_te = y_tr.repeat(len(doms)), y_te.repeat(len(doms))
        slot = {d: k for k, d in enumerate(doms)}
        train_idx = [i + slot[int(d)] * n_tr for i, d in zip(train_idx, part.domains)]
        test_idx = [i + slot[int(d)] * n_te for i, d in zip(test_idx, part.domains)]
    train_idx = [np.asarray(i, dtype=np.int64) for i in train_idx]
    perturb = PARTITIONS.get(partition, "partition").perturb
    local_from_train = False
    if perturb is not None:             # a partition that skews the inputs too (feature_noise)
        if not x_tr.is_floating_point():
            raise ConfigError("partition", partition, f"a partition that leaves the inputs as they are: "
                              f"'{partition}' perturbs numeric inputs, and dataset '{dataset}' gives "
                              f"{str(x_tr.dtype).replace('torch.', '')} inputs (token ids)")
        x_tr, y_tr, test_idx, local_from_train = _perturbed(perturb, x_tr, y_tr, x_te, y_te, train_idx, test_idx,
                                                            seed, part.meta.get("params", {}), local_test)
    meta = {"partition": partition, **params, **dict(part.meta)}
    if local_test == "split":       # each client's own 80/20 (`local_test_fraction`) split; before validation
        from fedprism.data.partition import local_holdout
        train_idx, test_idx = local_holdout(train_idx, y_tr.numpy(), local_test_fraction, seed,
                                            int(params.get("min_test", 1)))
        meta.update(local_test="split", local_test_fraction=local_test_fraction)
    val_idx = None
    if val_fraction > 0:            # each client's own validation rows, held out of its training rows
        val_idx = []
        for c, idx in enumerate(train_idx):
            k = int(np.floor(val_fraction * len(idx)))
            k = min(k, len(idx) - 1) if len(idx) > 1 else 0
            perm = np.random.default_rng([seed, 0x7A1, c]).permutation(len(idx))
            val_idx.append(np.sort(idx[perm[:k]]))
            train_idx[c] = np.sort(idx[perm[k:]])
    return Federation(_inputs(x_tr, vocab), y_tr.long(), _inputs(x_te, vocab), y_te.long(),
                      train_idx, [np.asarray(i, dtype=np.int64) for i in test_idx],
                      num_classes=len(ds.classes), class_names=list(ds.classes), name=dataset,
                      meta=meta, val_idx=val_idx, x_val=x_val, y_val=y_val,
                      local_pool="train" if local_test == "split" or local_from_train else "test", vocab_size=vocab)


def _inputs(x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The engines' inputs: float32, or the int64 ids of token data (`vocab_size` > 0)."""
    return (x.long() if vocab_size else x.float()).contiguous()


def _perturbed(perturb, x_tr, y_tr, x_te, y_te, train_idx, test_idx, seed, params, local_test):
    """A partition's `perturb` applied to each client's rows (`PartitionSpec.perturb`): its training rows in a
    copy of the training pool (the clients' rows are disjoint), and, with the official local test rows, a copy
    of each client's test rows perturbed as that client holds them, appended to the training pool (rows no
    client trains on; `local_pool = "train"`), since two clients may share a test row and the global test set
    stays as it is. With `data.local_test = split` the test rows are later held out of the perturbed training
    rows. Returns (x_train, y_train, test_idx, whether test_idx now index the training pool)."""
    n = len(train_idx)
    x_tr = x_tr.clone()
    for c, idx in enumerate(train_idx):
        rows = torch.as_tensor(idx)
        x_tr[rows] = perturb(x_tr[rows], c, n, "train", seed, params)
    if local_test == "split":
        return x_tr, y_tr, test_idx, False
    extra, extra_y, new_test, base = [], [], [], len(y_tr)
    for c, idx in enumerate(test_idx):
        rows = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        extra.append(perturb(x_te[rows], c, n, "test", seed, params))
        extra_y.append(y_te[rows])
        new_test.append(np.arange(base, base + len(idx), dtype=np.int64))
        base += len(idx)
    return torch.cat([x_tr, *extra]), torch.cat([y_tr, *extra_y]), new_test, True


def federation_key(cfg: Config) -> tuple:
    """Everything a config's federation depends on: configs with equal keys share one federation."""
    return (cfg["dataset"], cfg["data.root"], bool(cfg["data.download"]), _pad32(cfg, cfg["dataset"]),
            cfg["partition"], tuple(sorted(cfg.partition_params.items())), cfg["clients"], cfg["seed"],
            cfg["data.train_subset"], cfg["data.test_subset"], cfg["data.val_fraction"],
            cfg["data.global_val"], cfg["data.local_test"], cfg["data.local_test_fraction"],
            cfg["data.synthetic_devices"],
            tuple((k, cfg[k]) for k in DATASET_KEYS if k != "data.synthetic_devices"))


def clear_federations() -> None:
    """Drop this process's cached federations (`build_federation`): after a dataset's loader is registered
    again, or where only one client's rows (a Flower node) or none (a sweep's parent process) should stay
    in memory."""
    clear = getattr(_federation, "cache_clear", None)      # None where a test replaced the cached builder
    if clear is not None:
        clear()


def build_federation(cfg: Config) -> Federation:
    """The federation a config describes; cached, so every method of a sweep shares one partition."""
    fed = _federation(*federation_key(cfg))
    return Federation(fed.x_train, fed.y_train, fed.x_test, fed.y_test, fed.train_idx, fed.test_idx,
                      fed.num_classes, fed.class_names, fed.name, dict(fed.meta), fed.val_idx, fed.x_val, fed.y_val,
                      fed.local_pool, fed.vocab_size)


# -- clients that never train (`data.unseen_clients`) -------------------------------------------------
def held_out_clients(seed: int, num_clients: int, fraction: float) -> np.ndarray:
    """`data.unseen_clients`: the floor(fraction x N) clients held out of every cohort, sorted, drawn
    without replacement from a stream seeded by the run seed only (every method of a comparison holds out
    the same clients); empty at fraction 0."""
    from fedprism.experiment.config import held_out_count

    k = held_out_count(num_clients, fraction) if fraction > 0 else 0
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, 0x0A5E])
    return np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int64)


def unseen_mask(cfg: Config) -> np.ndarray | None:
    """[N] bool, True for the clients `data.unseen_clients` holds out; None when it is 0 (off)."""
    fraction = float(cfg.get("data.unseen_clients", 0.0) or 0.0)
    if fraction <= 0:
        return None
    mask = np.zeros(cfg["clients"], dtype=bool)
    mask[held_out_clients(cfg["seed"], cfg["clients"], fraction)] = True
    return mask


class SeenSelector:
    """A selection rule (`fedprism.selection.Selector`) run on the seen clients only: `inner` is built over
    the seen clients' sizes and label counts (indices 0..S-1), and every index it returns, hands to the
    loss query (Power-of-Choice) or records is mapped back to the federation's client ids. So the cohort
    of a round is the rule's cohort of a federation of the seen clients, m_t = max(floor(q S), 1) of them,
    and a held-out client is never drawn."""

    def __init__(self, inner, seen: np.ndarray):
        self.inner, self.seen = inner, np.asarray(seen, dtype=np.int64)

    @property
    def m(self) -> int:
        return self.inner.m

    def records(self) -> list[tuple]:
        out = []
        for kind, client, data in self.inner.records():
            if kind == "latency":               # per seen client, in the order of `seen`
                data = {**data, "clients": self.seen.tolist()}
            elif kind == "haccs_groups":
                data = {**data, "clients": self.seen.tolist()}
            out.append((kind, client, data))
        return out

    def select(self, rnd: int, loss_of=None) -> tuple[np.ndarray, dict]:
        seen = self.seen
        inner_loss = None if loss_of is None else (lambda cand: loss_of(seen[np.asarray(cand, dtype=np.int64)]))
        chosen, rec = self.inner.select(rnd, inner_loss)
        if "candidates" in rec:
            rec = {**rec, "candidates": seen[np.asarray(rec["candidates"], dtype=np.int64)].tolist()}
        return seen[np.asarray(chosen, dtype=np.int64)], rec
