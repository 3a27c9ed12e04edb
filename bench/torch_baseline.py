"""Framework baseline: the engine's sparse MLP (DESIGN.md §2) in PyTorch on CPU, one process and
DDP-style data-parallel, with time-to-accuracy curves and step throughput.

The network, loss, optimiser, batching and initialisation mirror the engine:

* ``H = relu(EmbeddingBag(X) + b1)`` — ``nn.EmbeddingBag(n_features, hidden, mode="sum")`` fed the
  CSR ``indices`` as ``input``, ``indptr[:-1]`` as ``offsets`` and the CSR ``data`` as
  ``per_sample_weights``; ``Z = nn.Linear(hidden, n_labels)(H)``.
* loss: softmax cross-entropy against the row-normalised label vector,
  ``loss = (1/B) Σ_rows -Σ_l (y_l/|y|) log softmax(z)_l`` (rows without labels contribute 0,
  ``B`` = rows in the batch, labelled or not) — the engine's summed loss divided by ``B``, so a
  plain SGD step with learning rate ``lr`` is the engine's step with the same ``lr``.
* plain ``torch.optim.SGD`` (no momentum, no weight decay), constant learning rate; or Adam
  (``--optimizer adam``: ``torch.optim.Adam`` on every parameter, ``W1`` with a dense gradient;
  ``--optimizer sparse_adam``: ``torch.optim.SparseAdam`` on the sparse ``W1`` gradient and
  ``Adam`` on the rest); or Adagrad (``--optimizer adagrad``, the engine's update without its
  decay). ``bench/bench_torch_adam.py`` grids Adam's learning rate against the engine's
  defaults, and with ``--optimizers adam sparse_adam adagrad`` Adam against Adagrad.
* init: ``W1`` uniform with variance ``1 / (avg_nnz * mean(x^2))`` (train-set statistics),
  ``W2`` Glorot-uniform, zero biases; drawn with the engine's NumPy generator and seed, so both
  start from the same weights.
* checked: the CLI first runs a few steps of this baseline and of the engine's CPU
  ``train_step`` from the same init on the same batches and prints the max parameter difference
  (float32 rounding, ~1e-8, when the two agree).
* batches: the engine's per-epoch permutation ``default_rng([seed, epoch]).permutation(n)``,
  consecutive slices of ``batch_size``; the last batch of an epoch may be smaller.

Training time counts the CSR-to-tensor conversion of each batch (the engine also slices its CSR
inside a step) and excludes evaluation, which is timed separately.

Threads: on a machine shared with other jobs, PyTorch's OpenMP pool with 2 threads on 2 busy
cores can run 10x slower than 1 thread (spinning workers wait for a descheduled peer); the results
record the load average and CPU time next to wall time, and the step throughput at 1 thread and at
``--threads``.

Data-parallel variant (``train_torch_ddp``): ``world_size`` processes started with
``torch.multiprocessing.spawn``, ``torch.distributed`` with the gloo backend over
``tcp://127.0.0.1:<free port>``, each process with ``threads // world_size`` threads. Every
process builds the same global batch and takes its contiguous ``1/world_size`` share of the rows.
The model is wrapped in ``DistributedDataParallel``. DDP's bucketed all-reduce does not accept
sparse gradients, so the DDP variant uses a *dense* ``EmbeddingBag`` gradient (``sparse=False``):
each step all-reduces the full ``n_features x hidden`` ``W1`` gradient. That is how a PyTorch user
would run DDP out of the box; it costs ``4 * n_features * hidden`` bytes per step (256 KiB on
delicious, 15 MiB on debian_debtags). Each rank's loss is scaled by ``world_size / B_global`` so
that DDP's gradient *average* equals the gradient of the single-process loss on the global batch.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from xmc_engine.scheduler.queue import epoch_permutation

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

try:  # torch is optional for the project; the CLI says how to install it
    import torch
    import torch.nn as nn
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None
    nn = None

TORCH_HINT = "PyTorch is not installed: pip install torch==2.13.0 (the CPU build)"


def _require_torch() -> None:
    if torch is None:
        raise _common.SkipBenchmark(TORCH_HINT)


# -- batches --------------------------------------------------------------------------------------

class Batch(NamedTuple):
    """One training batch in EmbeddingBag form.

    input : torch.LongTensor (nnz,) — feature ids of the batch rows, concatenated (CSR indices)
    offsets : torch.LongTensor (B,) — start of each row in ``input`` (CSR ``indptr[:-1]``)
    per_sample_weights : torch.FloatTensor (nnz,) — the feature values (CSR data)
    target : torch sparse COO (B, n_labels) float32, coalesced — ``1/|y_i|`` on row ``i``'s labels
    n_rows : int — ``B``, rows in the batch (labelled or not)
    """

    input: object
    offsets: object
    per_sample_weights: object
    target: object
    n_rows: int


def csr_to_batch(Xb, Yb) -> Batch:
    """Convert a CSR batch ``Xb`` (B, n_features) and ``Yb`` (B, n_labels) to a :class:`Batch`."""
    _require_torch()
    Xb = Xb.tocsr()
    Yb = Yb.tocsr()
    Yb.sum_duplicates()  # sorted, unique label ids per row: the COO below is coalesced
    B = Xb.shape[0]
    inp = torch.from_numpy(np.ascontiguousarray(Xb.indices, dtype=np.int64))
    offsets = torch.from_numpy(np.ascontiguousarray(Xb.indptr[:-1], dtype=np.int64))
    psw = torch.from_numpy(np.ascontiguousarray(Xb.data, dtype=np.float32))
    counts = np.diff(Yb.indptr)
    rows = np.repeat(np.arange(B, dtype=np.int64), counts)
    cols = Yb.indices.astype(np.int64)
    vals = (1.0 / np.maximum(counts, 1)).astype(np.float32)[rows]
    target = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([rows, cols])), torch.from_numpy(vals),
        size=(B, Yb.shape[1]), is_coalesced=True, check_invariants=False)
    return Batch(inp, offsets, psw, target, B)


def make_batches(X, Y, batch_size: int, seed: int, epoch: int, *, rows=None):
    """Yield the :class:`Batch` es of one epoch in the engine's order (lazily converted).

    Parameters
    ----------
    X : scipy.sparse.csr_matrix (n_samples, n_features) float32, host
    Y : scipy.sparse.csr_matrix (n_samples, n_labels), host, binary
    batch_size : int, rows per batch (the last batch of the epoch may be smaller)
    seed, epoch : int, select the permutation (the engine's
        :func:`~xmc_engine.scheduler.queue.epoch_permutation`)
    rows : optional slice applied to each batch's row ids (used by DDP ranks for their share)
    """
    n = X.shape[0]
    perm = epoch_permutation(n, seed, epoch)
    for start in range(0, n, batch_size):
        idx = perm[start:start + batch_size]
        if rows is not None:
            idx = idx[rows(len(idx))]
        yield csr_to_batch(X[idx], Y[idx])


# -- model ----------------------------------------------------------------------------------------

def engine_init(n_features: int, n_labels: int, hidden: int, X, seed: int,
                loss: str = "softmax"):
    """``[W1, b1, W2, b2]`` host float32 arrays drawn exactly as the engine's ``init_params``
    (with ``loss="bce"``: the output biases at ``-log(n_labels)``, as the engine's)."""
    try:
        from xmc_engine.model import ModelShape, init_params_for_data
    except ImportError:
        ModelShape = init_params_for_data = None
    if init_params_for_data is not None:
        return init_params_for_data(ModelShape(n_features, n_labels, (hidden,)), X, seed,
                                    loss=loss)
    if loss != "softmax":
        raise RuntimeError(f"loss={loss!r} needs the engine installed for its initialisation")
    avg_nnz = max(X.nnz / max(X.shape[0], 1), 1.0)
    rng = np.random.default_rng(seed)  # same draws as xmc_engine.model.init_params_for_data
    b1 = math.sqrt(3.0 / avg_nnz)
    W1 = rng.uniform(-b1, b1, size=(n_features, hidden)).astype(np.float32)
    b2 = math.sqrt(6.0 / (hidden + n_labels))
    W2 = rng.uniform(-b2, b2, size=(hidden, n_labels)).astype(np.float32)
    return [W1, np.zeros(hidden, np.float32), W2, np.zeros(n_labels, np.float32)]


class SparseMLP(nn.Module if nn is not None else object):
    """``relu(EmbeddingBag(X) + b1) @ W2 + b2`` — the engine's network with one hidden layer."""

    def __init__(self, n_features: int, n_labels: int, hidden: int = 128, *,
                 sparse: bool = True, init=None):
        super().__init__()
        self.emb = nn.EmbeddingBag(n_features, hidden, mode="sum", sparse=sparse)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.out = nn.Linear(hidden, n_labels)
        if init is not None:
            W1, b1, W2, b2 = init
            with torch.no_grad():
                self.emb.weight.copy_(torch.from_numpy(W1))
                self.b1.copy_(torch.from_numpy(b1))
                self.out.weight.copy_(torch.from_numpy(np.ascontiguousarray(W2.T)))
                self.out.bias.copy_(torch.from_numpy(b2))

    def forward(self, inp, offsets, per_sample_weights):
        h = self.emb(inp, offsets, per_sample_weights=per_sample_weights) + self.b1
        return self.out(torch.relu(h))


def batch_loss(logits, target, scale: float, loss: str = "softmax"):
    """``scale * Σ_{(i,l) in target} -target[i,l] * log_softmax(logits)[i,l]``; with
    ``loss="bce"`` the engine's logistic loss, ``scale * Σ_i Σ_l softplus(z_il) - y_il z_il``
    over the rows with labels (a row without labels contributes 0, as in the engine)."""
    idx = target.indices()
    if loss == "bce":
        labelled = torch.zeros(logits.shape[0], dtype=torch.bool)
        labelled[idx[0]] = True
        dense = torch.zeros_like(logits)
        dense[idx[0], idx[1]] = 1.0
        per = torch.nn.functional.binary_cross_entropy_with_logits(logits, dense,
                                                                   reduction="none")
        return per[labelled].sum() * scale
    if loss != "softmax":
        raise ValueError(f"loss={loss!r}: choose softmax or bce")
    logp = torch.log_softmax(logits, dim=1)
    return -(logp[idx[0], idx[1]] * target.values()).sum() * scale


def predict_topk_torch(model, X, k: int = 5, row_chunk: int = 4096) -> np.ndarray:
    """Top-``k`` label ids (n_samples, k) int64 of ``model`` on CSR ``X``, by descending score."""
    X = X.tocsr()
    out = np.empty((X.shape[0], k), dtype=np.int64)
    with torch.no_grad():
        for s in range(0, X.shape[0], row_chunk):
            Xb = X[s:s + row_chunk]
            z = model(torch.from_numpy(Xb.indices.astype(np.int64)),
                      torch.from_numpy(Xb.indptr[:-1].astype(np.int64)),
                      torch.from_numpy(Xb.data.astype(np.float32)))
            out[s:s + Xb.shape[0]] = torch.topk(z, k, dim=1).indices.numpy()
    return out


def evaluate(model, X_test, Y_test, ks=(1, 3, 5)) -> dict:
    """P@k / nDCG@k of ``model`` on the test set with the project's :class:`TopKMetrics`."""
    from xmc_engine.metrics import TopKMetrics

    k = min(max(ks), Y_test.shape[1])
    m = TopKMetrics(ks=ks)
    m.update(predict_topk_torch(model, X_test, k), Y_test)
    return {key: float(v) for key, v in m.result().items() if key.startswith(("P@", "nDCG@"))}


# -- training -------------------------------------------------------------------------------------

def _eval_points(n_samples: int, epochs: int, eval_every: float) -> list[int]:
    step = max(int(round(eval_every * n_samples)), 1)
    total = epochs * n_samples
    pts = list(range(step, total, step))
    return pts + [total]


#: ``train_torch``'s optimizers: plain SGD (the paper's), Adam on a dense ``W1`` gradient (what
#: ``torch.optim.Adam`` needs: ``EmbeddingBag(sparse=False)``), and "lazy" Adam
#: (``torch.optim.SparseAdam`` on the sparse ``W1`` gradient, ``Adam`` on the rest: only the
#: rows of a batch's features move, as in the engine), and Adagrad (``torch.optim.Adagrad`` on
#: every parameter, the ``W1`` gradient sparse; its defaults, ``eps=1e-10`` and a zero initial
#: accumulator, are the engine's Adagrad, which adds a learning-rate decay).
TORCH_OPTIMIZERS = ("sgd", "adam", "sparse_adam", "adagrad")


def make_optimizer(model, name: str, lr: float) -> list:
    """The ``torch.optim`` optimizers of :data:`TORCH_OPTIMIZERS` ``name`` over ``model``."""
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=lr)]
    if name == "adam":
        return [torch.optim.Adam(model.parameters(), lr=lr)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=lr)]
    if name == "sparse_adam":
        rest = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        return [torch.optim.SparseAdam(list(model.emb.parameters()), lr=lr),
                torch.optim.Adam(rest, lr=lr)]
    raise ValueError(f"optimizer {name!r}: choose one of {', '.join(TORCH_OPTIMIZERS)}")


def train_torch(X, Y, X_test, Y_test, *, hidden: int = 128, batch_size: int = 256,
                lr: float = 1.0, epochs: int = 10, threads: int = 2, seed: int = 0,
                eval_every: float = 1.0, verbose: bool = False,
                optimizer: str = "sgd", loss: str = "softmax") -> dict:
    """Train the single-process PyTorch baseline and record its time-to-accuracy curve.

    Parameters
    ----------
    X, Y : scipy.sparse.csr_matrix, train features (n, n_features) float32 / labels (n, n_labels)
    X_test, Y_test : scipy.sparse.csr_matrix, held-out set (evaluated in full)
    hidden, batch_size, lr, epochs, seed : as the engine's config
    threads : int, ``torch.set_num_threads`` (intra-op threads)
    eval_every : float, epochs between evaluations (also evaluated after the last batch)
    optimizer : one of :data:`TORCH_OPTIMIZERS` (default ``"sgd"``, no momentum); the Adam
        variants use PyTorch's default betas and eps
    loss : ``"softmax"`` or ``"bce"``, the engine's two training losses (:func:`batch_loss`)

    Returns
    -------
    dict with ``config``, ``curve`` (list of ``{"epoch", "samples", "train_time", "eval_time",
    "loss", "P@1", "P@3", "P@5", "nDCG@...}``; ``train_time`` excludes evaluation),
    ``train_time``, ``eval_time``, ``samples_per_s`` (training samples / training time),
    ``best`` (the record with the highest P@1) and ``peak_rss_mib``.
    """
    _require_torch()
    torch.set_num_threads(int(threads))
    torch.manual_seed(seed)
    n = X.shape[0]
    model = SparseMLP(X.shape[1], Y.shape[1], hidden, sparse=optimizer != "adam",
                      init=engine_init(X.shape[1], Y.shape[1], hidden, X, seed, loss))
    opts = make_optimizer(model, optimizer, lr)
    points = _eval_points(n, epochs, eval_every)
    curve, samples, train_time, eval_time, loss_sum, loss_rows = [], 0, 0.0, 0.0, 0.0, 0
    train_cpu = 0.0
    for epoch in range(epochs):
        t0, c0 = time.perf_counter(), time.process_time()
        for b in make_batches(X, Y, batch_size, seed, epoch):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            step_loss = batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                                   1.0 / b.n_rows, loss)
            step_loss.backward()
            for opt in opts:
                opt.step()
            samples += b.n_rows
            loss_sum += float(step_loss.detach()) * b.n_rows
            loss_rows += b.n_rows
            if points and samples >= points[0]:
                train_time += time.perf_counter() - t0
                train_cpu += time.process_time() - c0
                while points and samples >= points[0]:
                    points.pop(0)
                te = time.perf_counter()
                rec = {"epoch": samples / n, "samples": samples, "train_time": train_time,
                       "train_cpu_time": train_cpu, "loss": loss_sum / max(loss_rows, 1)}
                rec.update(evaluate(model, X_test, Y_test))
                loss_sum, loss_rows = 0.0, 0
                rec["eval_time"] = time.perf_counter() - te
                eval_time += rec["eval_time"]
                curve.append(rec)
                if verbose:
                    print(_fmt_record(rec), flush=True)
                t0, c0 = time.perf_counter(), time.process_time()
        train_time += time.perf_counter() - t0
        train_cpu += time.process_time() - c0
    best = max(curve, key=lambda r: r["P@1"]) if curve else None
    return {
        "variant": "torch", "config": {"hidden": hidden, "batch_size": batch_size, "lr": lr,
                                       "epochs": epochs, "threads": threads, "seed": seed,
                                       "eval_every": eval_every, "sparse_grad": optimizer != "adam",
                                       "optimizer": optimizer, "loss": loss},
        "curve": curve, "train_time": train_time, "train_cpu_time": train_cpu,
        "eval_time": eval_time,
        "samples_per_s": samples / train_time if train_time > 0 else None,
        "best": best, "peak_rss_mib": _common.peak_rss_mib(),
    }


def step_throughput(X, Y, *, hidden: int = 128, batch_size: int = 256, threads: int = 2,
                    n_steps: int = 50, lr: float = 0.1, seed: int = 0, warmup: int = 5,
                    sparse: bool = True) -> float:
    """Training samples per second of pure SGD steps (forward, backward, update).

    Batches are converted before timing (the conversion is data loading, not a step); ``warmup``
    steps run first and are not timed. Returns full-batch samples/s over ``n_steps`` steps.
    """
    _require_torch()
    torch.set_num_threads(int(threads))
    model = SparseMLP(X.shape[1], Y.shape[1], hidden, sparse=sparse,
                      init=engine_init(X.shape[1], Y.shape[1], hidden, X, seed))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    batches, epoch = [], 0
    while len(batches) < warmup + n_steps:
        batches += [b for b in make_batches(X, Y, batch_size, seed, epoch)
                    if b.n_rows == batch_size or X.shape[0] < batch_size]
        epoch += 1
    batches = batches[:warmup + n_steps]

    def step(b):
        opt.zero_grad(set_to_none=True)
        batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                   1.0 / b.n_rows).backward()
        opt.step()

    for b in batches[:warmup]:
        step(b)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    dt = time.perf_counter() - t0
    return sum(b.n_rows for b in batches[warmup:]) / dt


def check_against_engine(X, Y, *, hidden: int = 128, batch_size: int = 256, lr: float = 1.0,
                         n_steps: int = 3, seed: int = 0, optimizer: str = "sgd") -> dict | None:
    """Run ``n_steps`` steps of this baseline and of the engine's CPU step from the same init on
    the same batches; return the max abs parameter difference per tensor and the last mean
    losses (``None`` when the engine's CPU backend is not importable). ``optimizer``: ``"sgd"``
    (the engine's ``train_step``) or ``"adagrad"`` (its ``grad_step`` and ``apply_adagrad``,
    against ``torch.optim.Adagrad``)."""
    _require_torch()
    if optimizer not in ("sgd", "adagrad"):
        raise ValueError(f"optimizer {optimizer!r}: the check covers sgd and adagrad")
    try:
        from xmc_engine.backends import get_backend
        from xmc_engine.model import apply_adagrad, grad_step, train_step
    except ImportError:
        return None
    init = engine_init(X.shape[1], Y.shape[1], hidden, X, seed)
    be = get_backend("cpu", threads=1)
    params = [be.asarray(p.copy()) for p in init]
    acc = [be.asarray(np.zeros_like(p)) for p in init]
    model = SparseMLP(X.shape[1], Y.shape[1], hidden, init=init)
    (opt,) = make_optimizer(model, optimizer, lr)
    perm = epoch_permutation(X.shape[0], seed, 0)
    loss_e = loss_t = float("nan")
    for s in range(n_steps):
        rows = perm[s * batch_size:(s + 1) * batch_size]
        if len(rows) == 0:
            break
        if optimizer == "sgd":
            loss_e = train_step(be, params, X[rows], Y[rows], lr) / len(rows)
        else:
            loss_sum, grads = grad_step(be, params, X[rows], Y[rows])
            apply_adagrad(be, params, grads, acc, lr)
            loss_e = loss_sum / len(rows)
        b = csr_to_batch(X[rows], Y[rows])
        opt.zero_grad(set_to_none=True)
        loss = batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                          1.0 / b.n_rows)
        loss.backward()
        opt.step()
        loss_t = float(loss.detach())
    mine = [model.emb.weight, model.b1, model.out.weight.T, model.out.bias]
    diff = {name: float(np.max(np.abs(np.asarray(be.to_host(a)) - t.detach().numpy())))
            for name, a, t in zip(("W1", "b1", "W2", "b2"), params, mine, strict=True)}
    return {"n_steps": n_steps, "lr": lr, "optimizer": optimizer, "max_abs_diff": diff,
            "loss_engine": loss_e,
            "loss_torch": loss_t}


# -- DDP ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _share(rank: int, world_size: int):
    """Rows of a global batch that rank ``rank`` takes: contiguous, sizes differ by at most 1."""
    def rows(n: int) -> slice:
        return slice(rank * n // world_size, (rank + 1) * n // world_size)
    return rows


def _ddp_worker(rank, world_size, port, threads, data, cfg, queue):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(int(threads) // world_size, 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        X, Y, X_test, Y_test = data
        n, seed, bs = X.shape[0], cfg["seed"], cfg["batch_size"]
        model = SparseMLP(X.shape[1], Y.shape[1], cfg["hidden"], sparse=False,
                          init=engine_init(X.shape[1], Y.shape[1], cfg["hidden"], X, seed))
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
        points = _eval_points(n, cfg["epochs"], cfg["eval_every"])
        curve, samples, train_time, eval_time = [], 0, 0.0, 0.0
        loss_sum, loss_rows = 0.0, 0
        for epoch in range(cfg["epochs"]):
            dist.barrier()
            t0 = time.perf_counter()
            share = _share(rank, world_size)
            for i, b in enumerate(make_batches(X, Y, bs, seed, epoch, rows=share)):
                b_global = min(bs, n - i * bs)
                opt.zero_grad(set_to_none=True)
                # DDP averages gradients over ranks: scale so the average is d(sum/B_global).
                loss = batch_loss(ddp(b.input, b.offsets, b.per_sample_weights), b.target,
                                  world_size / b_global)
                loss.backward()
                opt.step()
                samples += b_global
                loss_sum += float(loss.detach()) * b_global / world_size
                loss_rows += b_global
                if points and samples >= points[0]:
                    train_time += time.perf_counter() - t0
                    while points and samples >= points[0]:
                        points.pop(0)
                    te = time.perf_counter()
                    if rank == 0:
                        rec = {"epoch": samples / n, "samples": samples,
                               "train_time": train_time,
                               "loss_rank0": loss_sum / max(loss_rows, 1)}
                        rec.update(evaluate(model, X_test, Y_test))
                        rec["eval_time"] = time.perf_counter() - te
                        eval_time += rec["eval_time"]
                        curve.append(rec)
                        if cfg.get("verbose"):
                            print(_fmt_record(rec), flush=True)
                    loss_sum, loss_rows = 0.0, 0
                    dist.barrier()  # the other ranks wait while rank 0 evaluates
                    t0 = time.perf_counter()
            train_time += time.perf_counter() - t0
        rss = torch.tensor([_common.peak_rss_mib()], dtype=torch.float64)
        dist.all_reduce(rss)
        if rank == 0:
            queue.put({"curve": curve, "train_time": train_time, "eval_time": eval_time,
                       "samples": samples, "peak_rss_mib_sum_ranks": float(rss[0])})
    finally:
        dist.destroy_process_group()


def train_torch_ddp(X, Y, X_test, Y_test, *, world_size: int = 2, hidden: int = 128,
                    batch_size: int = 256, lr: float = 1.0, epochs: int = 10, threads: int = 2,
                    seed: int = 0, eval_every: float = 1.0, verbose: bool = False) -> dict:
    """DDP-style synchronous data-parallel PyTorch baseline (see the module docstring).

    ``batch_size`` is the *global* batch, split evenly over ``world_size`` processes, each with
    ``threads // world_size`` threads (at least 1). Same arguments and result keys as
    :func:`train_torch`; ``train_time`` is rank 0's (the ranks are synchronised every step) and
    ``peak_rss_mib`` is the sum over the ranks plus the launching process.
    """
    _require_torch()
    import torch.multiprocessing as mp

    cfg = {"hidden": hidden, "batch_size": batch_size, "lr": lr, "epochs": epochs,
           "seed": seed, "eval_every": eval_every, "verbose": verbose}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    # Workers inherit these; keeps each rank to its own thread budget in OpenMP/BLAS too.
    per_rank = str(max(int(threads) // world_size, 1))
    old = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({"OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank})
    try:
        mp.spawn(_ddp_worker, args=(world_size, port, threads, (X, Y, X_test, Y_test), cfg,
                                    queue), nprocs=world_size, join=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res = queue.get()
    curve = res["curve"]
    tt = res["train_time"]
    return {
        "variant": f"torch_ddp{world_size}",
        "config": dict(cfg, threads=threads, world_size=world_size, sparse_grad=False,
                       backend="gloo", threads_per_rank=int(per_rank)),
        "curve": curve, "train_time": tt, "eval_time": res["eval_time"],
        "samples_per_s": res["samples"] / tt if tt > 0 else None,
        "best": max(curve, key=lambda r: r["P@1"]) if curve else None,
        "peak_rss_mib": res["peak_rss_mib_sum_ranks"] + _common.peak_rss_mib(),
    }


# -- CLI ------------------------------------------------------------------------------------------

def _fmt_record(r: dict) -> str:
    cpu = f" (cpu {r['train_cpu_time']:7.2f}s)" if "train_cpu_time" in r else ""
    return (f"  epoch {r['epoch']:6.2f}  train {r['train_time']:8.2f}s{cpu}  "
            f"P@1 {r['P@1']:.4f}  P@3 {r['P@3']:.4f}  P@5 {r['P@5']:.4f}  "
            f"(eval {r['eval_time']:.2f}s)")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (separate from the work they trigger)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", default=None,
                   help="dataset name under the data dir (repeatable; default delicious)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, nargs="+", default=[1.0],
                   help="learning rate; several values run a grid and keep every curve")
    p.add_argument("--optimizer", choices=TORCH_OPTIMIZERS, default="sgd",
                   help="optimizer of the single-process run (the DDP variant: SGD)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=1.0, help="epochs between evaluations")
    p.add_argument("--ddp", type=int, default=0, metavar="WORLD_SIZE",
                   help="also run the DDP-style variant with this many processes")
    p.add_argument("--no-single", action="store_true", help="skip the single-process run")
    p.add_argument("--throughput-steps", type=int, default=100,
                   help="steps for the pure step-throughput measurement, run with 1 thread and "
                        "with --threads (0 = skip)")
    p.add_argument("--out", default=None,
                   help="result file (default bench/results/torch_<dataset>.json)")
    return p.parse_args(argv)


def run_dataset(name: str, args) -> dict | None:
    """Run the requested variants on one dataset; print the curves; return the JSON payload."""
    try:
        X, Y, X_test, Y_test = _common.load_dataset(name)
    except _common.SkipBenchmark as e:
        print(f"SKIP {name}: {e}")
        return None
    meta = _common.result_metadata(machine_extra={"torch_threads": args.threads})
    check = check_against_engine(X, Y, hidden=args.hidden, batch_size=args.batch_size,
                                 lr=args.lr[0], seed=args.seed)
    if check is None:
        print(f"{name}: engine CPU backend not importable; no step-by-step check")
    else:
        worst = max(check["max_abs_diff"].values())
        print(f"{name}: check vs engine train_step, {check['n_steps']} steps lr={check['lr']}: "
              f"max |param diff| {worst:.2e}, loss {check['loss_torch']:.6f} (torch) vs "
              f"{check['loss_engine']:.6f} (engine)", flush=True)
        if not worst < 1e-4:
            print(f"{name}: WARNING: the PyTorch step and the engine's train_step differ "
                  f"(non-finite engine loss = an engine bug, not the baseline's)")
    runs = []
    common = dict(hidden=args.hidden, batch_size=args.batch_size, epochs=args.epochs,
                  threads=args.threads, seed=args.seed, eval_every=args.eval_every, verbose=True)
    for lr in args.lr:
        variants = [] if args.no_single else [("torch", train_torch,
                                                {"optimizer": args.optimizer})]
        if args.ddp:
            variants.append((f"torch_ddp{args.ddp}", train_torch_ddp, {"world_size": args.ddp}))
        for label, fn, extra in variants:
            print(f"{name} {label} lr={lr} hidden={args.hidden} batch={args.batch_size} "
                  f"threads={args.threads}", flush=True)
            res = fn(X, Y, X_test, Y_test, lr=lr, **common, **extra)
            b = res["best"]
            print(f"{name} {label} lr={lr}: best P@1 {b['P@1']:.4f} at epoch {b['epoch']:.2f} "
                  f"(train {b['train_time']:.2f}s); {res['samples_per_s']:.0f} samples/s; "
                  f"peak RSS {res['peak_rss_mib']:.0f} MiB", flush=True)
            runs.append(res)
    tput = {}
    for t in sorted({1, args.threads}) if args.throughput_steps > 0 else []:
        tput[str(t)] = step_throughput(X, Y, hidden=args.hidden, batch_size=args.batch_size,
                                       threads=t, n_steps=args.throughput_steps)
        print(f"{name} torch step throughput, {t} thread(s): {tput[str(t)]:.0f} samples/s "
              f"({args.throughput_steps} steps of {args.batch_size}, warm-up excluded)")
    best = max(runs, key=lambda r: r["best"]["P@1"]) if runs else None
    payload = {
        **meta, "benchmark": "torch_baseline", "dataset": name,
        "shape": {"n_train": X.shape[0], "n_test": X_test.shape[0], "n_features": X.shape[1],
                  "n_labels": Y.shape[1]},
        "check_vs_engine": check, "runs": runs,
        "step_throughput_samples_per_s_by_threads": tput,
        "best": None if best is None else {"variant": best["variant"],
                                           "lr": best["config"]["lr"], **best["best"],
                                           "samples_per_s": best["samples_per_s"]},
    }
    return payload


def main(argv=None) -> int:
    """Entry point: run every requested dataset, write ``bench/results/torch_<dataset>.json``."""
    args = parse_args(argv)
    if torch is None:
        print(f"SKIP: {TORCH_HINT}")
        return 0
    for name in args.data or ["delicious"]:
        payload = run_dataset(name, args)
        if payload is None:
            continue
        out = Path(args.out) if args.out else _common.RESULTS_DIR / f"torch_{name}.json"
        _common.write_result(out, payload)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
