"""The composition root: a configuration -> federation, model, context, engine, algorithm and the round
loop's callbacks, built one way for the simulator (`runner.Experiment`) and for Flower (the ServerApp's
`flower.server.FlowerExperiment` and each node's `flower.node`), so both run the same objects.

    fed   = build_federation(cfg)                       (experiment/federation.py)
    model = make_model(cfg, fed.input_shape, fed.num_classes)
    ctx   = make_context(cfg, model, fed.n_train, fed.label_hist())
    engine = make_engine(...); ctx.spec = engine.spec    (`build_engine`)
    algo  = make_algorithm(cfg, ctx, fed.input_shape)
    callbacks = round_callbacks(experiment)             (experiment/callbacks.py, experiment/scalars.py)

`fedprism.experiment.runner` re-exports every factory here, so `from fedprism.experiment.runner import
make_model` keeps working.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Algorithm
from fedprism.engine import make_engine
from fedprism.engine.base import LocalConfig
from fedprism.errors import ConfigError
from fedprism.experiment.config import Config
from fedprism.experiment.federation import dataset_vocab, resolve_model_name
from fedprism.experiment.limits import check_limits
from fedprism.federation import Federation
from fedprism.models import build_model
from fedprism.params import flatten
from fedprism.attacks import Attack
from fedprism.compression import Compressor
from fedprism.local_dp import LocalDPSGD, check_model
from fedprism.privacy import Privacy, UpdateDP
from fedprism.protocol import Context, TrainSettings
from fedprism.selection import Selector, cohort_size


def local_config(cfg: Config) -> LocalConfig:
    """The client-side training settings of a config."""
    return LocalConfig(epochs=cfg["local_epochs"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                       momentum=cfg["momentum"], weight_decay=cfg["weight_decay"], optimizer=cfg["optimizer"],
                       eval_precision=cfg.get("eval.precision", "float32"),
                       train_precision=cfg.get("train.precision", "float32"),
                       eval_kernels=cfg.get("eval.kernels", "aten"),
                       train_kernels=cfg.get("train.kernels", "aten"))


def make_model(cfg: Config, input_shape: tuple[int, ...], num_classes: int,
               vocab_size: int | None = None) -> torch.nn.Module:
    """The config's model, initialised from the run seed (same seed -> same initial vector). A
    registered (plugin) model is checked first: a torch module with finite weights whose output on a
    batch of the data's input shape is [batch, num_classes]. `vocab_size`: the data's token vocabulary
    (`Federation.vocab_size`; 0 for float inputs); None reads it from the dataset's spec (a Flower server
    that holds no data)."""
    from fedprism.models import MODELS

    vocab = dataset_vocab(cfg["dataset"]) if vocab_size is None else int(vocab_size)
    name = resolve_model_name(cfg["model"], input_shape, vocab)
    model = build_model(name, input_shape, num_classes, seed=cfg["seed"], vocab_size=vocab,
                        dataset=cfg["dataset"])
    if not MODELS.is_builtin(name):
        _check_plugin_model(name, model, tuple(input_shape), num_classes, vocab)
    return model


def _check_plugin_model(name: str, model: object, input_shape: tuple[int, ...], num_classes: int,
                        vocab_size: int = 0) -> None:
    # a batch of the data's kind: float zeros, or token id 0 of token data
    dtype = torch.int64 if vocab_size else torch.float32

    def bad(what: str) -> ConfigError:
        return ConfigError("model", name, f"a registered model {what}")

    if not isinstance(model, torch.nn.Module):
        raise bad(f"builder returns a torch.nn.Module; it returned {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise bad("has parameters to train; this one has none")
    from fedprism.params import running_layers
    try:
        running_layers(model)          # a torch BatchNorm updating its buffers in place: no engine can
    except ValueError as e:
        raise bad(f"uses BatchNorm that fedprism can train; {e}") from None
    lazy = torch.nn.parameter.is_lazy
    if not all(lazy(p) or bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise bad("starts from finite weights; this one holds NaN or inf")
    was = model.training
    model.eval()                                   # no dropout draw, no BatchNorm statistics update
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):      # a forward that draws: not the run's
            out = model(torch.zeros((2, *input_shape), dtype=dtype))
    except Exception as e:  # noqa: BLE001 - the plugin's own error, chained
        raise bad(f"takes inputs of the data's shape {list(input_shape)}: {type(e).__name__}: {e}") from e
    finally:
        model.train(was)
    _check_logits(bad, out, input_shape, num_classes, "")
    import copy

    try:
        twin = copy.deepcopy(model).train()        # training mode on a copy: its BatchNorm statistics move
    except Exception:  # noqa: BLE001 - a model that cannot be copied is checked by its first round instead
        return
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = twin(torch.zeros((2, *input_shape), dtype=dtype))
    except Exception as e:  # noqa: BLE001 - the plugin's own error, chained
        raise bad(f"takes inputs of the data's shape {list(input_shape)} in training mode: "
                  f"{type(e).__name__}: {e}") from e
    _check_logits(bad, out, input_shape, num_classes, " in training mode")


def _check_logits(bad, out: object, input_shape: tuple[int, ...], num_classes: int, mode: str) -> None:
    ok = isinstance(out, torch.Tensor) and tuple(out.shape) == (2, num_classes) and out.is_floating_point()
    if not ok:
        shape = f"{list(out.shape)} of {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise bad(f"maps [batch, {', '.join(map(str, input_shape))}] to [batch, {num_classes}] "
                  f"floating-point logits{mode}; it gave {shape} for a batch of 2")


def make_context(cfg: Config, model: torch.nn.Module, n_train: np.ndarray, label_hist: np.ndarray) -> Context:
    """The algorithm's view of the federation (sizes and label counts, no raw data). `spec` is
    filled in by the caller once the engine (or a `Functional`) has laid the parameters out.

    With `privacy.epsilon` > 0 the label counts are the clients' DP releases (fedprism.privacy), made
    once per client, and `ctx.privacy` holds the calibrated plan for the prototype releases."""
    privacy = privacy_plan(cfg)
    if privacy is not None:
        label_hist = np.stack([privacy.label_counts(h, privacy.generator(cfg["seed"], 0, i, "labels")).numpy()
                               for i, h in enumerate(label_hist)]) if len(label_hist) else label_hist
    return Context(num_clients=len(n_train), num_classes=int(label_hist.shape[1]), spec=None, init=flatten(model),
                   n_train=n_train, label_hist=label_hist, seed=cfg["seed"], rounds=cfg["rounds"],
                   fraction=cfg["fraction"], feature_dim=feature_dim(model), privacy=privacy,
                   train=TrainSettings.of(local_config(cfg)),     # what the engine's LocalConfig says
                   dp=update_dp(cfg, len(n_train)), compress=Compressor.of(cfg), attack=Attack.of(cfg, len(n_train)))


def update_dp(cfg: Config, num_clients: int) -> UpdateDP | None:
    """The run's DP-FedAvg plan (None when `dp.clip` is 0): the cohort is drawn from the seen clients
    (`data.unseen_clients`), m = cohort_size of them; a selection rule other than uniform chooses clients by
    what they reported, so the accountant is told every client takes part (q = 1, no amplification)."""
    if not cfg.get("dp.clip", 0.0):
        return None
    from fedprism.experiment.config import held_out_count

    seen = num_clients - (held_out_count(num_clients, cfg["data.unseen_clients"])
                          if cfg.get("data.unseen_clients", 0.0) > 0 else 0)
    m = cohort_size(seen, cfg["fraction"]) if cfg.get("selection", "uniform") == "uniform" else seen
    return UpdateDP.of(cfg, seen, m)


def privacy_plan(cfg: Config) -> Privacy | None:
    """The run's privacy plan (None when `privacy.epsilon` is 0)."""
    eps = cfg.get("privacy.epsilon", 0.0)
    if not eps:
        return None
    return Privacy.plan(eps, cfg["privacy.delta"], cfg["privacy.clip"], cfg["privacy.noise"], cfg["rounds"],
                        getattr(REGISTRY[cfg["method"]], "shares_prototypes", False))


def feature_dim(model: torch.nn.Module) -> int:
    """Width of the penultimate features (the input of the model's `head`), 0 if it has no head."""
    head = getattr(model, "head", None)
    lin = [m for m in head.modules() if isinstance(m, torch.nn.Linear)] if head is not None else []
    return int(lin[0].in_features) if lin else 0


def make_selector(cfg: Config, ctx: Context, algo: Algorithm) -> Selector:
    """The run's client-selection rule (fedprism.selection), its settings checked against the run. With
    `data.unseen_clients` the rule runs on the seen clients only (`federation.SeenSelector`)."""
    from fedprism.experiment.federation import SeenSelector, unseen_mask

    held = unseen_mask(cfg)
    seen = np.arange(ctx.num_clients) if held is None else np.flatnonzero(~held)
    rule, N = cfg.get("selection", "uniform"), len(seen)
    m = cohort_size(N, cfg["fraction"])
    d = cfg.get("selection.d", 0) or min(N, 2 * m)
    if rule != "uniform" and algo.own_cohort:
        raise ConfigError("selection", rule, f"uniform: {cfg['method']} draws its own cohort (per cluster); "
                          f"set {cfg['method']}.sampling=global to combine it with a selection rule")
    if rule == "poc":
        if not m <= d <= N:
            raise ConfigError("selection.d", cfg["selection.d"], f"an integer in [{m}, {N}] (m_t = {m} clients per "
                              f"round, {N} clients), or 0 for min(clients, 2 m_t)")
        if type(algo).model_for is Algorithm.model_for:
            raise ConfigError("selection", "poc", f"a method whose server holds each client's model (model_for); "
                              f"{cfg['method']} keeps its models on the clients")
    sel = Selector(rule, cfg["seed"], N, cfg["fraction"], np.asarray(ctx.n_train)[seen],
                   np.asarray(ctx.label_hist)[seen], d=d, rho=cfg.get("selection.rho", 0.95),
                   tau=cfg.get("selection.tau", 0.1))
    return sel if held is None else SeenSelector(sel, seen)


def drift_schedule(cfg: Config, fed: Federation):
    """The run's class-drift schedule (`drift.*`, fedprism.data.drift), None for static data."""
    if not cfg.get("drift.fraction", 0.0):
        return None
    from fedprism.data.drift import make_schedule
    return make_schedule(fed.label_hist(), cfg["drift.fraction"], cfg["drift.remove"], cfg["drift.every"],
                         cfg["seed"])


def warn_if_nothing_personal(cfg: Config, algo: Algorithm, input_shape: tuple[int, ...]) -> None:
    """A method that keeps part of the model on each client (FedBN, FedPer, FedRep) but finds no such part
    in this model (FedBN on a model without BatchNorm) runs as FedAvg, bit for bit: say so once."""
    from fedprism.algorithms.partial import PartialSharing

    if isinstance(algo, PartialSharing) and not bool(algo.mask_private.any()):
        import warnings

        model = resolve_model_name(cfg["model"], input_shape)
        warnings.warn(f"{cfg['method']} keeps no parameter of model {model} on the clients "
                      f"(model={cfg['model']}), so this run is FedAvg's; for FedBN choose a model with BatchNorm "
                      "(lenet5_bn, mlp_bn)", stacklevel=3)


def make_algorithm(cfg: Config, ctx: Context, input_shape: tuple[int, ...] | None = None) -> Algorithm:
    """The config's method on `ctx`. A method that refuses the model `model=auto` chose for the data
    (`input_shape`) says that the user left `auto` and which model it chose."""
    try:
        return with_uplink(REGISTRY[cfg["method"]](ctx, **cfg.method_params))
    except ConfigError as e:
        if e.key != "model" or cfg["model"] != "auto" or input_shape is None:
            raise
        chosen = resolve_model_name("auto", input_shape)
        raise ConfigError("model", "auto", f"{e.allowed}; `auto` chose {chosen} for {cfg['dataset']}, "
                          f"{e.value}: name a model (model=...)") from None


def with_uplink(algo: Algorithm) -> Algorithm:
    """`algo` ready for DP-FedAvg and compression: under `dp.clip` its upload must be the one tensor it
    averages (anything else it sends would leave the client without noise); under `compress` with error
    feedback the residuals (`ef.<tensor>`) join its declared client state, so the runner keeps, checkpoints
    and restores them as it does the method's own rows (on this instance only)."""
    ctx = algo.ctx
    if ctx.dp is not None:
        names = sorted(algo.upload())
        if len(names) != 1:
            raise ConfigError("dp.clip", ctx.dp.clip, f"0 for method={algo.name}: its upload holds "
                              f"{', '.join(names) or 'nothing'}, and DP-FedAvg protects the one model update a "
                              "client sends (the other tensors would leave the client without noise)")
    if ctx.compress is not None and ctx.compress.feedback:
        extra = ctx.compress.residual_state(algo.upload())
        if extra:
            scored_by_clients = algo.client_side_inference()      # the residuals play no part in inference
            algo.client_state = {**type(algo).client_state, **extra}
            algo.client_side_inference = lambda: scored_by_clients
    return algo


def check_runnable(cfg: Config, fed: Federation, n_params: int, store_path: str | Path) -> None:
    """The checks a run passes before it trains, given its data and its model's size: the limits of
    `limits.check_limits` (K against the clients and a round's cohort, batch size against the data,
    memory, and disk beside the store for `state.storage=mmap`) and the learned gate's rows. Called by
    `Experiment` and, for every run of a sweep before the first starts, by `sweep.check_runs`."""
    check_limits(cfg, fed.n_train, n_params,
                 disk=_free_disk(store_path) if cfg.get("state.storage") == "mmap" else None)
    if cfg.get("eval.gate", "none") != "none":
        from fedprism.experiment.limits import available_memory

        REGISTRY[cfg["method"]].learned_gate().check_memory(fed, available_memory())


def _free_disk(path) -> int | None:
    """Free bytes on the file system of `path` (the store: row files live beside it), None if unknown."""
    import shutil
    from pathlib import Path

    try:
        return shutil.disk_usage(Path(path).resolve().parent).free
    except OSError:
        return None


def build_engine(cfg: Config, fed: Federation, model: torch.nn.Module, ctx: Context):
    """The config's engine (`engine=`) over the federation's data; lays the parameters out in `ctx.spec`."""
    local_dp = LocalDPSGD.of(cfg)        # dp.local=dpsgd: Opacus' DP-SGD in the sequential loop (auto picks it)
    if local_dp is not None:
        check_model(model, cfg["model"])
    engine = make_engine("sequential" if local_dp is not None else cfg["engine"], fed, model, local_config(cfg),
                         cfg["seed"], cfg["device"], compile=cfg["compile"], rounds=cfg["rounds"],
                         fuse_jobs=cfg["fuse_jobs"], cuda_graphs=cfg["cuda_graphs"])
    engine.local_dp = local_dp
    ctx.spec = engine.spec
    return engine


def round_callbacks(exp) -> list:
    """The round loop's callbacks for an experiment (`Experiment.callbacks`), in the order they run: class
    drift, evaluation sampling, the learned gate, the `scalars=DIR` files, checkpoints and the progress bar
    (experiment/callbacks.py, experiment/scalars.py). The in-process run and the Flower ServerApp get the
    same list. Built before the run is started: a `scalars` folder that cannot hold its files is a
    `ConfigError` then. `Scalars` comes before `Checkpoint`: a round whose CSV rows could not be written
    is not checkpointed, so the resumed run redoes it."""
    from fedprism.experiment import callbacks as cb

    cfg = exp.cfg
    out: list = []
    if getattr(exp, "drift", None) is not None:
        out.append(cb.Drift())
    if int(cfg.get("eval.clients", 0) or 0):
        out.append(cb.EvalSampling(int(cfg["eval.clients"])))
    if cfg.get("eval.gate", "none") != "none":
        out.append(cb.Gate())
    out += _scalars(exp)
    out += [cb.Checkpoint(), cb.ProgressBar(exp.progress)]
    return out


def rescore_callbacks(exp) -> list:
    """The callbacks of a re-scored run (`Experiment.rescore`: one evaluation of a kept final state, stored as
    the last round, no training): the `scalars=DIR` files when `scalars` is set, else none. Built before the
    run is started, as `round_callbacks` is."""
    return _scalars(exp)


def _scalars(exp) -> list:
    """`scalars=DIR`: [the run's `Scalars` callback] (experiment/scalars.py; makes the folder and files or
    raises the `ConfigError`), or [] when the key is ''."""
    if not exp.cfg.get("scalars"):
        return []
    from fedprism.experiment.scalars import Scalars

    return [Scalars(exp.cfg["scalars"], exp.run_id)]
