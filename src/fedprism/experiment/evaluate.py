"""The one evaluation path: in process and on a Flower node alike.

A method says, through `Algorithm.eval_payload` (server side) and `Algorithm.inference` (client side),
which model(s) each client predicts with and how their logits combine (`fedprism.protocol.Inference`).
This module scores that on each client's local test split and on the global test set:

* **one model** (`Inference.single`): the engine's batched evaluation with exact caching. A model row
  is identified by a hash of its bytes: a client whose model did not change since its last evaluation
  is not scored again, and identical models (FedAvg's one shared model) are scored on the global test
  set once.
* **several streams** (an ensemble, `fedprism_dual`'s routed streams): the streams' logits are computed
  in chunks, combined, and scored; the alternative predictions (`Inference.alternatives`) are scored
  from the same logits. On the shared sets (the global test set, and the global validation set when the
  federation has one) each stream's logits are cached per client, keyed by a hash of the stream's row,
  so only streams that changed since the last evaluation are run again.
  Streams listed in `Inference.features` yield penultimate features instead of logits (`fedproto`'s
  nearest-prototype prediction), computed, cached and handed to `combine` / `alternatives` the same way.

Results are exact, not approximations: a cached score is the score the same model gets again.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.protocol import EvalResult, Inference, Rows

SPLITS = ("local", "global", "train", "val", "global_val")
SHARED = ("global", "global_val")
#: label of the padding rows of a batched own-split chunk (`StreamScorer._own_batches`): cross-entropy's
#: default ignore index, never a prediction
PAD_LABEL = -100
#: largest per-stream logit cache on the global test set (bytes); beyond it logits are recomputed
STREAM_CACHE_BYTES = 512 << 20
#: an evaluation scores clients in blocks whose model rows take at most this many bytes in float64
#: (LeNet-5: 543 clients); federations of one block are scored in one call, as before blocks existed
EVAL_BLOCK_BYTES = 256 << 20


def _is_all(clients: np.ndarray, n: int) -> bool:
    c = np.asarray(clients)
    return len(c) == n and bool((c == np.arange(n)).all())


def sample_eval_clients(seed: int, rnd: int, num_clients: int, k: int) -> np.ndarray:
    """`eval.clients`: the k clients (sorted, without replacement) scored at round `rnd`, from a stream
    seeded by (seed, round) only, so every method of a comparison scores the same clients."""
    rng = np.random.default_rng([seed, rnd, 0xE7A1])
    return np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int64)


#: (pid, width, pool) of `row_hashes`' threads; a forked child makes its own (the parent's threads are not
#: in it)
_HASHERS: tuple[int, int, ThreadPoolExecutor] | None = None


def row_hashes(params: torch.Tensor) -> list[bytes]:
    """A 16-byte blake2b digest of each row's float32 bytes: the caches' exact identity of a model.

    Rows are hashed in as many threads as torch may use (`torch.get_num_threads()`, the run's `threads`):
    hashlib releases the GIL on buffers this large, and on a GPU run with one thread hashing took nearly
    half of a FedAvg evaluation (bench/README.md, "Where a GPU evaluation goes")."""
    global _HASHERS
    a = params.detach().to("cpu", torch.float32).contiguous().numpy()

    def part(rows: range) -> list[bytes]:
        return [hashlib.blake2b(memoryview(a[i]), digest_size=16).digest() for i in rows]

    width = min(len(a), torch.get_num_threads())
    if width < 2:
        return part(range(len(a)))
    if _HASHERS is None or _HASHERS[0] != os.getpid() or _HASHERS[1] < width:
        if _HASHERS is not None and _HASHERS[0] == os.getpid():
            _HASHERS[2].shutdown(wait=False)              # a wider pool replaces it (more threads now)
        _HASHERS = (os.getpid(), width, ThreadPoolExecutor(width, thread_name_prefix="fedprism-hash"))
    step = -(-len(a) // width)
    parts = [range(i, min(len(a), i + step)) for i in range(0, len(a), step)]
    return [h for hs in _HASHERS[2].map(part, parts) for h in hs]


def macro_f1(conf: torch.Tensor) -> torch.Tensor:
    """Per-model macro-F1 over the classes present in the true labels; conf [n, C, C]."""
    c = conf.double()
    tp = c.diagonal(dim1=1, dim2=2)
    support = c.sum(2)
    predicted = c.sum(1)
    denom = support + predicted
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
    present = support > 0
    return (f1 * present).sum(1) / present.sum(1).clamp(min=1)


class StreamScorer:
    """Scores an `Inference` with several streams (or a combination) on one split, on any Trainer.

    Call shapes follow the engine: the vectorized engine's `eval_samples` x `eval_models` (compiled),
    the sequential engine's `eval_chunk`. Streams are stacked in their declared order into one logits
    call per client on local splits; on the shared sets (global test, global validation) every stream's
    logits come from a per-client cache refreshed in groups of the engine's width.
    """

    def __init__(self, engine, num_clients: int):
        self.engine, self.N = engine, num_clients
        self.chunk = int(getattr(engine, "eval_samples", 0) or getattr(getattr(engine, "cfg", None), "eval_chunk", 500)
                         or 500)
        self.device = dev = torch.device(getattr(engine, "device", "cpu"))
        width = getattr(engine, "eval_models", None)
        self.budget = self.chunk * width if width else 1 << (18 if dev.type == "cuda" else 13)
        self.caches: dict[str, dict] = {}
        #: clients' own splits scored many clients per call (`_own_batches`, per-client inputs) instead of
        #: one client at a time: on CUDA, where the per-client loop's launches dominated (bench/README.md,
        #: GPU). Elsewhere the loop stays: its logits are the stored runs' bit for bit.
        self.batch_own = dev.type == "cuda" and hasattr(engine, "logits_own")

    def _run_own(self, params: torch.Tensor, x: torch.Tensor, features: bool) -> torch.Tensor:
        """[n, B, C] logits (or features) of model i on its own batch x[i] ([n, B, ...])."""
        return self.engine.features_own(params, x) if features else self.engine.logits_own(params, x)

    def _run(self, params: torch.Tensor, x: torch.Tensor, features: bool) -> torch.Tensor:
        """[n, B, C] logits, or [n, B, d] penultimate features, of n models on one input batch."""
        return self.engine.features(params, x) if features else self.engine.logits(params, x)

    def _cached_logits(self, name: str, rows: torch.Tensor, clients: np.ndarray, x: torch.Tensor,
                       features: bool = False, split: str = "global", host_rows: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """[N, N_test, C] logits (or [N, N_test, d] features) of stream `name` on the shared set `split`
        (x), refreshed for changed rows. `host_rows`: the same rows where they came from (the host), to
        be hashed there rather than copied back from the device."""
        key = (f"{name}#features" if features else name) + ("" if split == "global" else f"@{split}")
        cache = self.caches.get(key)
        if cache is None or cache["n_test"] != len(x):
            width = (self._run(rows[:1], x[:2], True).shape[-1] if features and len(rows)
                     else self.engine.num_classes)
            cache = {"n_test": len(x), "hash": [b""] * self.N, "logits": None, "width": width}
        if self.N * len(x) * cache["width"] * 4 > STREAM_CACHE_BYTES:
            return None
        self.caches[key] = cache
        host = rows if host_rows is None else host_rows
        head = getattr(getattr(self.engine, "spec", None), "head", None) if features else None
        if head is not None and head.stop > head.start:
            # penultimate features never read the head: rows that differ only there (a shared body under
            # personal heads: GPFL) are one model here, hashed with the head zeroed and run once
            host = host.clone()
            host[:, head] = 0
        hashes = row_hashes(host)
        stale = [i for i, c in enumerate(clients) if cache["hash"][int(c)] != hashes[i]]
        # equal rows are run once (the components every client shares: FedEM), the others copy the result
        first: dict[bytes, int] = {}
        for i in stale:
            first.setdefault(hashes[i], i)
        uniq = list(first.values())
        per = max(1, self.budget // self.chunk)
        # the row and destination indices go to the device once: an index tensor on the host would be one
        # copy (and one wait for the device) per chunk
        src = torch.as_tensor(uniq, dtype=torch.long).to(rows.device)
        dst = torch.as_tensor(clients[uniq], dtype=torch.long).to(self.device)
        for g0 in range(0, len(uniq), per):
            params = rows[src[g0:g0 + per]]
            for s0 in range(0, len(x), self.chunk):
                z = self._run(params, x[s0:s0 + self.chunk], features)
                if cache["logits"] is None:
                    cache["logits"] = torch.zeros(self.N, len(x), z.shape[-1], device=z.device, dtype=z.dtype)
                cache["logits"][dst[g0:g0 + per], s0:s0 + self.chunk] = z
        copies = [i for i in stale if first[hashes[i]] != i]
        if copies:
            to = torch.as_tensor(clients[copies], dtype=torch.long).to(self.device)
            frm = torch.as_tensor(clients[[first[hashes[i]] for i in copies]], dtype=torch.long).to(self.device)
            cache["logits"][to] = cache["logits"][frm]
        for i in stale:
            cache["hash"][int(clients[i])] = hashes[i]
        return cache["logits"]

    def _own_batches(self, clients: np.ndarray, split: str, streams: int):
        """Clients' own splits in groups, padded: (rows, x [m, L, ...], y [m, L], valid [m, L] bool).
        Padding rows have zero inputs and the label `PAD_LABEL`: no prediction equals it and the
        cross-entropy ignores it, so only the confusion matrix needs `valid`.

        A group holds as many clients as the engine's evaluation width allows for `streams` stacked
        streams; a client with more than `chunk` rows is scored over several windows."""
        data = [self.engine.data(int(c), split) for c in clients]
        per = max(1, self.budget // (self.chunk * streams))
        for g0 in range(0, len(clients), per):
            grp = range(g0, min(len(clients), g0 + per))
            longest = max(len(data[i][1]) for i in grp)
            x0 = data[grp[0]][0]
            for s0 in range(0, longest, self.chunk):
                L = min(self.chunk, longest - s0)
                x = torch.zeros(len(grp), L, *x0.shape[1:], dtype=x0.dtype, device=x0.device)
                y = torch.full((len(grp), L), PAD_LABEL, dtype=torch.long, device=x0.device)
                valid = torch.zeros(len(grp), L, dtype=torch.bool, device=x0.device)
                for j, i in enumerate(grp):
                    xi, yi = data[i][0][s0:s0 + L], data[i][1][s0:s0 + L]
                    x[j, :len(yi)], y[j, :len(yi)], valid[j, :len(yi)] = xi, yi, True
                yield slice(g0, grp[-1] + 1), x, y, valid

    @torch.no_grad()
    def __call__(self, inf: Inference, clients: np.ndarray, split: str) -> EvalResult:
        if split not in SPLITS:
            raise ValueError(f"split must be local, global or train, got {split!r}")
        clients = np.asarray(clients)
        n, C, chunk = len(clients), self.engine.num_classes, self.chunk
        names = list(inf.streams)
        feats = set(inf.features)
        if feats - set(names):
            raise ValueError(f"Inference.features names unknown streams: {sorted(feats - set(names))}")
        if inf.combine is None and names[0] in feats:
            raise ValueError(f"the headline prediction needs logits: stream {names[0]!r} yields features; "
                             "give Inference.combine")
        combine = inf.combine or (lambda z, e: z[names[0]])
        dev = self.device
        # the streams' rows and the extras (label priors, masks) come from the server's state and client
        # state, which live on the CPU: each goes to the device once per call, not once per chunk (on
        # CUDA every copy from the host also waits for the device)
        streams = {s: inf.streams[s].to(dev) for s in names}
        extras = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in inf.extras.items()}
        # sums stay on the device until the end: no host synchronisation per chunk (integer counts and
        # float64 sums, so the totals are those of summing on the host)
        correct = torch.zeros(n, dtype=torch.long, device=dev)
        loss = torch.zeros(n, dtype=torch.float64, device=dev)
        count = torch.zeros(n, dtype=torch.long, device=dev)
        conf = torch.zeros(n, C, C, dtype=torch.long, device=dev)
        alt: dict[str, torch.Tensor] = {}

        def score(rows: slice, x: torch.Tensor, y: torch.Tensor, z: dict[str, torch.Tensor],
                  valid: torch.Tensor | None = None) -> None:
            """One chunk: x [B, ...] shared by the rows' clients, or with `valid` x [m, B, ...] per client."""
            m = rows.stop - rows.start
            for is_feat in (False, True):           # one stacked call for the logit streams, one for features
                todo = [s for s in names if s not in z and (s in feats) == is_feat]
                if todo:
                    p = torch.cat([streams[s][rows] for s in todo])
                    out = (self._run(p, x, is_feat) if valid is None else
                           self._run_own(p, x.repeat(len(todo), *([1] * (x.dim() - 1))), is_feat))
                    z = {**z, **{s: out[j * m:(j + 1) * m] for j, s in enumerate(todo)}}
            ex = {k: v[rows] for k, v in extras.items()}
            out = combine(z, ex).float()
            yy = y.to(out.device).expand(m, -1)
            pred = out.argmax(-1)
            correct[rows] += (pred == yy).sum(1)
            ce = F.cross_entropy(out.reshape(-1, C), yy.reshape(-1), reduction="none", ignore_index=PAD_LABEL)
            loss[rows] += ce.view(m, -1).double().sum(1)
            # confusion cells counted with index_add_, not bincount or a boolean mask: both wait for the
            # device on CUDA (bincount reads the largest cell, a mask its count); padding rows add 0
            own = torch.arange(m, device=out.device)[:, None] * (C * C)
            cells = (own + yy.clamp(min=0) * C + pred).reshape(-1)
            if valid is None:
                count[rows] += len(y)
                ones = torch.ones_like(cells)
            else:
                valid = valid.to(out.device)
                count[rows] += valid.sum(1)
                ones = valid.reshape(-1).long()
            conf[rows].view(-1).index_add_(0, cells, ones)
            for name, fn in inf.alternatives.items():
                hit = (fn(z, ex).argmax(-1) == yy).sum(1)
                if name not in alt:
                    alt[name] = torch.zeros(n, dtype=torch.long, device=dev)
                alt[name][rows] += hit

        if split in SHARED:
            x_all, y_all = self.engine.data(int(clients[0]) if n else 0, split)
            cached = {s: self._cached_logits(s, streams[s], clients, x_all, s in feats, split,
                                         host_rows=inf.streams[s])
                      for s in names}
            cached = {s: v for s, v in cached.items() if v is not None}
            per = max(1, self.budget // (chunk * max(1, len(names) - len(cached))))
            ids = torch.as_tensor(clients, dtype=torch.long).to(dev)
            for g0 in range(0, n, per):
                rows = slice(g0, min(n, g0 + per))
                for s0 in range(0, len(y_all), chunk):
                    z = {s: v[ids[rows], s0:s0 + chunk] for s, v in cached.items()}
                    score(rows, x_all[s0:s0 + chunk], y_all[s0:s0 + chunk], z)
        elif self.batch_own:
            for rows, x, y, valid in self._own_batches(clients, split, len(names)):
                score(rows, x, y, {}, valid)
        else:
            for i, c in enumerate(clients):
                x_all, y_all = self.engine.data(int(c), split)
                for s0 in range(0, len(y_all), chunk):
                    score(slice(i, i + 1), x_all[s0:s0 + chunk], y_all[s0:s0 + chunk], {})
        return EvalResult(correct.cpu(), loss.cpu(), count.cpu(), conf.cpu(),
                          {k: v.cpu() for k, v in alt.items()})


def score_inference(engine, scorer: StreamScorer, inf: Inference, clients: np.ndarray, split: str) -> EvalResult:
    """Uncached scoring of an Inference on one split (a Flower node; the runner uses `Evaluator`)."""
    single = inf.single
    if single is not None:
        return engine.evaluate(single, clients, split)
    return scorer(inf, clients, split)


@dataclass
class ClientScores:
    """Per-client arrays of one evaluation (NaN where a split is empty or not evaluated); entry j belongs
    to client `clients[j]` (every client, or the clients sampled for this evaluation: `eval.clients`)."""

    clients: np.ndarray
    local_acc: np.ndarray
    local_loss: np.ndarray
    local_f1: np.ndarray
    n_test: np.ndarray
    global_acc: np.ndarray
    global_f1: np.ndarray
    evaluated: int            # model-evaluations actually computed (for the speed report)
    #: per-client accuracies of an algorithm's alternative predictions, `<split>_acc@<name>`
    alternatives: dict[str, np.ndarray] = field(default_factory=dict)
    #: per-client accuracies on the validation splits, `val_acc` / `global_val_acc` (when the federation has them)
    validation: dict[str, np.ndarray] = field(default_factory=dict)
    #: entry j is a held-out client (`data.unseen_clients`); None: every client is a seen one
    unseen: np.ndarray | None = None

    def subset(self, keep: np.ndarray) -> "ClientScores":
        """The entries where `keep` (bool) is True."""
        return ClientScores(self.clients[keep], self.local_acc[keep], self.local_loss[keep], self.local_f1[keep],
                            self.n_test[keep], self.global_acc[keep], self.global_f1[keep], self.evaluated,
                            {k: v[keep] for k, v in self.alternatives.items()},
                            {k: v[keep] for k, v in self.validation.items()})


#: the name of the fine-tuned prediction of `eval.finetune` (`<split>_acc@ft`)
FINETUNED = "ft"
#: `eval.finetune`'s random stream and its round: the batch order is a pure function of (seed, client), the
#: same at every evaluation, independent of the training streams (another name), so a block, a re-scored run
#: and an uninterrupted run fine-tune the same model from the same start (as FedBABU's fine-tuning)
FINETUNE_STREAM, FINETUNE_ROUND = "eval_finetune", 0


def finetune_models(engine, clients: np.ndarray, start: torch.Tensor, epochs: int) -> torch.Tensor:
    """[n, P]: each client's `start` row after `epochs` local epochs on its training rows, with the run's
    local optimiser settings (optimiser, learning rate, momentum, weight decay, batch size; fresh optimiser
    state), the plain cross-entropy objective and the whole model trained (`eval.finetune`)."""
    from fedprism.protocol import TrainJob

    job = TrainJob(np.asarray(clients, dtype=np.int64), start, epochs=int(epochs), stream=FINETUNE_STREAM)
    return engine.train(job, FINETUNE_ROUND).params


def check_finetune(algo, engine, state: dict, value: int) -> None:
    """`eval.finetune` > 0: refuse, before training, a method that cannot say which model a client would
    fine-tune (`Algorithm.finetune_start` raises), by building one client's inference from `state` (the
    initial server state) and fresh client state, as a newcomer's."""
    from fedprism.errors import ConfigError

    c = np.zeros(1, dtype=np.int64)
    payload, cs = algo.eval_payload(state, c), algo.fresh_client_state(c)
    try:
        algo.finetune_start(algo.inference(engine, c, payload, cs), payload, cs)
    except ConfigError as e:
        if e.key != "eval.finetune":
            raise
        raise ConfigError("eval.finetune", value, e.allowed) from None


def _rows(r: EvalResult) -> list[tuple]:
    f1 = macro_f1(r.confusion)
    return [(int(r.correct[i]), int(r.count[i]), float(r.loss_sum[i]), float(f1[i])) for i in range(len(r.count))]


class Evaluator:
    """Scores every client's inference, with the caches living for the whole run.

    Splits: 'local' (each client's test split) and, with `do_global`, 'global' (the shared test set);
    `validation` adds 'val' (each client's validation rows) and/or 'global_val' (the global validation
    set), reported as `val_acc` / `global_val_acc` and used to choose hyper-parameters."""

    def __init__(self, engine, num_clients: int, do_global: bool = True, validation: tuple[str, ...] = (),
                 finetune: int = 0, unseen: np.ndarray | None = None):
        self.engine = engine
        self.n = num_clients
        self.do_global = do_global
        self.validation = tuple(validation)
        self.streams = StreamScorer(engine, num_clients)
        self._own: dict[str, dict[int, tuple[bytes, tuple]]] = {}
        self._shared: dict[str, dict[bytes, tuple]] = {}
        #: `eval.finetune`: local epochs of fine-tuning before the `ft` prediction (0: none)
        self.finetune = int(finetune)
        #: `data.unseen_clients`: [N] bool, True for the held-out clients (None: every client trains)
        self.unseen = None if unseen is None or not np.asarray(unseen).any() else np.asarray(unseen, dtype=bool)
        #: the fine-tuned models' scores, cached apart from the headline's (a client's two models)
        self._ft: Evaluator | None = None

    def forget(self) -> None:
        """Drop the cached per-client scores of the clients' own splits (their data changed)."""
        self._own.clear()
        if self._ft is not None:
            self._ft.forget()

    @property
    def splits(self) -> list[str]:
        return ["local"] + (["global"] if self.do_global else []) + list(self.validation)

    def inference(self, algo, state: dict, cstate: Rows) -> Inference:
        clients = np.arange(self.n)
        return algo.inference(self.engine, clients, algo.eval_payload(state, clients), cstate)

    def block_size(self) -> int:
        """Clients evaluated together: as many as keep one float64 copy of their model rows within
        `EVAL_BLOCK_BYTES` (a server's personalised models are mixed in float64), at least one."""
        spec = getattr(self.engine, "spec", None)
        P = int(getattr(spec, "size", 0) or 0)
        return max(1, EVAL_BLOCK_BYTES // (8 * P)) if P else max(1, self.n)

    def __call__(self, algo, state: dict, cstate=None, clients: np.ndarray | None = None) -> ClientScores:
        """Score `algo`'s inference for `clients` (default: every client). `cstate` is the clients' own
        state: every client's rows (a dict) or a client store (`fedprism.experiment.clientstore`, whose
        `view(clients)` gives a block's rows). Clients are scored in blocks of `block_size()`, each block's
        payload and inference built on its own, so no [N, P] float64 (or [N, P] client state) is ever
        materialised; a federation of at most one block is scored exactly as one call."""
        everyone = clients is None
        clients = np.arange(self.n) if everyone else np.asarray(clients, dtype=np.int64)
        if cstate is None:
            cstate = {}
        if isinstance(cstate, dict):
            def rows_of(c):
                return cstate if _is_all(c, self.n) else {k: v[torch.as_tensor(c)] for k, v in cstate.items()}
        else:
            rows_of = cstate.view
        size = self.block_size()
        if self.finetune or self.unseen is not None:
            return self._with_options(algo, state, rows_of, clients, size)
        if everyone and self.n <= size:
            return self.score(self.inference(algo, state, rows_of(clients)))
        parts = []
        live: dict[str, set] = {}
        for b0 in range(0, len(clients), size):
            block = clients[b0:b0 + size]
            inf = algo.inference(self.engine, block, algo.eval_payload(state, block), rows_of(block))
            parts.append(self._score_block(inf, block, live))
            del inf
        self._prune(live)
        results = {s: [r for p in parts for r in p[0][s]] for s in self.splits}
        raw = {s: EvalResult.concat([p[1][s] for p in parts], self.engine.num_classes)
               for s in (parts[0][1] if parts else {})}
        return self._scores(results, sum(p[2] for p in parts), _alternatives(raw), clients)

    def _with_options(self, algo, state: dict, rows_of, clients: np.ndarray, size: int) -> ClientScores:
        """`__call__` under `eval.finetune` and/or `data.unseen_clients`. The seen clients' blocks are built
        as always (`eval_payload`, `inference`, their client-state rows); the held-out clients' blocks with
        the newcomer hooks (`newcomer_payload`, `newcomer_inference`) and fresh client state. Each block is
        scored as `__call__` scores a block; with `eval.finetune` each client then fine-tunes
        (`finetune_start`, `finetune_models`) and the fine-tuned models are scored on the same splits, as
        the alternative prediction `ft`. The scores come back in the order of `clients`, and
        `ClientScores.unseen` marks the held-out clients (`summarize` reports them apart)."""
        held = np.zeros(len(clients), bool) if self.unseen is None else self.unseen[clients]
        live: dict[str, set] = {}
        ft_live: dict[str, set] = {}
        parts: list[tuple[np.ndarray, dict, dict, int]] = []
        for newcomer in (False, True):
            members = clients[held == newcomer]
            for b0 in range(0, len(members), size):
                block = members[b0:b0 + size]
                if newcomer:
                    payload, cs = algo.newcomer_payload(state, block), algo.fresh_client_state(block)
                    inf = algo.newcomer_inference(self.engine, block, payload, cs)
                else:
                    payload, cs = algo.eval_payload(state, block), rows_of(block)
                    inf = algo.inference(self.engine, block, payload, cs)
                results, raw, evaluated = self._score_block(inf, block, live)
                alternatives = _alternatives(raw)
                if self.finetune:
                    tuned = finetune_models(self.engine, block, algo.finetune_start(inf, payload, cs), self.finetune)
                    if self._ft is None:
                        self._ft = Evaluator(self.engine, self.n, self.do_global, self.validation)
                    ft, _, k = self._ft._score_block(Inference({"model": tuned}), block, ft_live)
                    evaluated += k
                    for split, rows in ft.items():
                        alternatives[f"{split}_acc@{FINETUNED}"] = np.array(
                            [r[0] / r[1] if r[1] else np.nan for r in rows])
                parts.append((block, results, alternatives, evaluated))
                del inf
        self._prune(live)
        if self._ft is not None:
            self._ft._prune(ft_live)
        order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
        results = {s: [r for p in parts for r in p[1][s]] for s in self.splits}
        results = {s: [rows[i] for i in order] for s, rows in results.items()}
        names = sorted({k for p in parts for k in p[2]})
        alternatives = {k: np.concatenate([p[2].get(k, np.full(len(p[0]), np.nan)) for p in parts])[order]
                        for k in names}
        scores = self._scores(results, sum(p[3] for p in parts), alternatives,
                              np.concatenate([p[0] for p in parts])[order])
        scores.unseen = None if self.unseen is None else self.unseen[scores.clients]
        return scores

    def score(self, inf: Inference, clients: np.ndarray | None = None) -> ClientScores:
        """Score one inference of `clients` (default: every client; its rows are those clients' rows)."""
        clients = np.arange(self.n) if clients is None else np.asarray(clients, dtype=np.int64)
        live: dict[str, set] = {}
        results, raw, evaluated = self._score_block(inf, clients, live)
        self._prune(live)
        return self._scores(results, evaluated, _alternatives(raw), clients)

    def _score_block(self, inf: Inference, clients: np.ndarray, live: dict[str, set]
                     ) -> tuple[dict[str, list[tuple]], dict[str, EvalResult], int]:
        params = inf.single
        results: dict[str, list[tuple]] = {}
        raw: dict[str, EvalResult] = {}
        evaluated = 0
        hashes = row_hashes(params) if params is not None else None          # once for every split
        for split in self.splits:
            if params is None:
                raw[split] = self.streams(inf, clients, split)
                results[split] = _rows(raw[split])
                evaluated += len(clients)
            else:
                results[split], k = self._cached(params, hashes, clients, split, live)
                evaluated += k
        return results, raw, evaluated

    def _prune(self, live: dict[str, set]) -> None:
        """Keep only the shared-split scores of models evaluated this time."""
        for split, hs in live.items():
            self._shared[split] = {h: r for h, r in self._shared.get(split, {}).items() if h in hs}

    def _cached(self, params: torch.Tensor, hashes: list[bytes], clients: np.ndarray, split: str,
                live: dict[str, set]) -> tuple[list, int]:
        """Row j of `params` is client clients[j]'s model."""
        if split not in SHARED:
            cache = self._own.setdefault(split, {})
            todo = [j for j, c in enumerate(clients) if cache.get(int(c), (None,))[0] != hashes[j]]
            if todo:
                res = _rows(self.engine.evaluate(params[torch.as_tensor(todo)], clients[todo], split))
                for j, r in zip(todo, res):
                    cache[int(clients[j])] = (hashes[j], r)
            return [cache[int(c)][1] for c in clients], len(todo)
        cache = self._shared.setdefault(split, {})
        need = {}
        for i, h in enumerate(hashes):
            if h not in cache and h not in need:
                need[h] = i
        if need:
            idx = list(need.values())
            res = _rows(self.engine.evaluate(params[torch.as_tensor(idx)], clients[idx], split))
            for h, r in zip(need, res):
                cache[h] = r
        live.setdefault(split, set()).update(hashes)
        return [cache[h] for h in hashes], len(need)

    def _scores(self, results: dict[str, list], evaluated: int, alternatives: dict,
                clients: np.ndarray | None = None) -> ClientScores:
        def acc(rows):
            return np.array([r[0] / r[1] if r[1] else np.nan for r in rows])

        local, glob = results["local"], results.get("global")
        n = len(local)
        n_test = np.array([r[1] for r in local])
        return ClientScores(
            clients=np.arange(n) if clients is None else np.asarray(clients, dtype=np.int64),
            local_acc=acc(local),
            local_loss=np.array([r[2] / r[1] if r[1] else np.nan for r in local]),
            local_f1=np.array([r[3] if r[1] else np.nan for r in local]),
            n_test=n_test,
            global_acc=acc(glob) if glob is not None else np.full(n, np.nan),
            global_f1=np.array([r[3] for r in glob]) if glob is not None else np.full(n, np.nan),
            evaluated=evaluated,
            alternatives=alternatives,
            validation={f"{s}_acc": acc(results[s]) for s in self.validation if s in results},
        )

    def from_results(self, results: dict[str, EvalResult]) -> ClientScores:
        """Scores from per-client results computed elsewhere (each Flower node scored its own inference)."""
        return self._scores({s: _rows(r) for s, r in results.items()},
                            sum(len(r.count) for r in results.values()), _alternatives(results))


def _alternatives(results: dict[str, EvalResult]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for split, r in results.items():
        n = r.count.double().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            for name, correct in r.alternatives.items():
                out[f"{split}_acc@{name}"] = np.where(n > 0, correct.double().numpy() / n, np.nan)
    return out


def _nanmean(x: np.ndarray) -> float:
    """`np.nanmean`, and NaN without numpy's "Mean of empty slice" warning when every entry is NaN (a
    diverged run's losses): the run already says it diverged."""
    return float("nan") if np.all(np.isnan(x)) else float(np.nanmean(x))


def summarize(s: ClientScores) -> dict:
    """Round-level metrics from per-client scores (docs/architecture.md, "Fine-tuning and unseen clients").
    With held-out clients (`ClientScores.unseen`) every metric below averages the seen clients only, and the
    held-out ones are summarised apart: `unseen_local_acc` (mean over those with local test rows),
    `unseen_local_acc_weighted`, `unseen_local_f1`, `unseen_local_loss`, their alternative predictions on
    the local split (`unseen_local_acc@<name>`) and their count `unseen_clients`."""
    if s.unseen is not None and s.unseen.any():
        out = summarize(s.subset(~s.unseen))
        out.update(_unseen(s.subset(s.unseen)))
        return out
    ok = s.n_test > 0
    la = s.local_acc[ok]
    out = {
        "local_acc": float(np.mean(la)) if la.size else float("nan"),
        "local_acc_weighted": float(np.sum(la * s.n_test[ok]) / max(1, s.n_test[ok].sum())),
        "local_loss": _nanmean(s.local_loss) if ok.any() else float("nan"),
        "local_f1": _nanmean(s.local_f1) if ok.any() else float("nan"),
        "ad": float(1 - np.mean(la)) if la.size else float("nan"),
        "sdad": float(np.std(la)) if la.size else float("nan"),
        "clients_without_test": int((~ok).sum()),
    }
    if not np.all(np.isnan(s.global_acc)):
        out["global_acc"] = float(np.mean(s.global_acc))
        out["global_acc_std"] = float(np.std(s.global_acc))
        out["global_f1"] = float(np.mean(s.global_f1))
    for name, acc in {**s.validation, **s.alternatives}.items():   # mean over the clients with samples there
        if not np.all(np.isnan(acc)):
            out[name] = float(np.nanmean(acc))
    return out


def _unseen(s: ClientScores) -> dict:
    """The held-out clients' local metrics (`summarize`), named `unseen_<metric>`."""
    ok = s.n_test > 0
    la = s.local_acc[ok]
    out = {"unseen_clients": int(len(s.clients)),
           "unseen_local_acc": float(np.mean(la)) if la.size else float("nan"),
           "unseen_local_acc_weighted": float(np.sum(la * s.n_test[ok]) / max(1, s.n_test[ok].sum())),
           "unseen_local_loss": _nanmean(s.local_loss) if ok.any() else float("nan"),
           "unseen_local_f1": _nanmean(s.local_f1) if ok.any() else float("nan")}
    for name, acc in s.alternatives.items():
        if name.startswith("local_acc@") and not np.all(np.isnan(acc)):
            out[f"unseen_{name}"] = float(np.nanmean(acc))
    return out
