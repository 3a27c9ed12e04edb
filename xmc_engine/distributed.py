"""Several machines: one process per node, node-merged models combined by a weighted all-reduce.

DESIGN.md §6, arXiv 2110.07029 §III-B. ``mpiexec -n N xmc-engine train ...`` starts one process
(rank) per node; each runs the node-local trainer (:class:`~xmc_engine.scheduler.Trainer`)
over its own devices on its own share of the rows. At every merge the policy first merges its
node's replicas as usual (``w̄_node = Σ_i p_i w_i``), then :meth:`NodeComm.combine` replaces it,
on every rank, by

    ``w̄ = Σ_node c_node w̄_node / Σ_node c_node``

with ``c_node`` the updates the node made in the period (for model averaging: its replicas), so
normalized merging holds across nodes as it does within one. The central momentum and the
broadcast to the node's replicas then run identically on every rank.

Merge cadence. Every rank must merge equally often, or the all-reduces pair up wrongly. The global
merge period ``S`` gives ``P = max(1, round(n_samples / S))`` periods per epoch
(:func:`periods_per_epoch`, computed from global counts, so the same on every rank); each rank's
queue cuts its shard into exactly ``P`` periods (``BatchQueue.n_periods``), i.e. a period of
``S_r ≈ S n_r / n_samples`` samples on rank ``r``: nodes share ``S`` in proportion to their rows.
Inside a node the scheduling stays dynamic; a faster node simply waits at the all-reduce, which is
the cross-node barrier (balance nodes through their shares, not through the merge).

Failure handling: every collective has a deadline (``timeout``, ``XMC_COMM_TIMEOUT``). A rank
whose Python code raises reports the error to rank 0 and rank 0 stops the job with a message
naming it (:meth:`MPIComm.fail`); a rank that stalls makes rank 0 stop the job after the deadline,
naming the rank that did not reach the merge; a rank killed outright (signal, ``os._exit``) is
reported by the launcher, which stops the others (non-zero exit status).

Fault injection for the tests: ``XMC_MPI_FAULT=RANK:MERGE:MODE`` makes rank ``RANK`` fail at its
``MERGE``-th merge (1-based) with ``MODE`` one of ``raise`` (an exception), ``hang`` (sleeps
forever), ``exit`` (``os._exit(1)``, no clean-up).

GPUs: when the merged arrays are CuPy arrays and ``cupy.cuda.nccl`` is available, the big
all-reduce goes through NCCL (one GPU per rank; the unique id travels over MPI); otherwise the
arrays are staged through host memory and MPI.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from xmc_engine import _env
from xmc_engine.errors import ConfigError, DistributedError, InjectedFault

logger = logging.getLogger(__name__)

__all__ = ["LocalComm", "MPIComm", "NodeComm", "combine_nodes", "init", "join_run", "node_queue",
           "periods_per_epoch", "world"]

DEFAULT_TIMEOUT = 600.0  # seconds; covers a merge period plus rank 0's evaluation/checkpoint
_TAG_WEIGHT = 7101
_TAG_ERROR = 7102
EXIT_FAILED = 1   # a rank failed (exception): status of the job
EXIT_TIMEOUT = 3  # a collective missed its deadline
FAULT_MODES = ("raise", "hang", "exit")
ABORT_GRACE_S = 0.5  # seconds between the last message and MPI_Abort


def periods_per_epoch(n_samples: int, merge_period: int, min_rows: int | None = None) -> int:
    """Merge periods per epoch of a multi-node run: ``max(1, round(n_samples / S))``, at most
    ``min_rows`` (the smallest shard) so that every node has a row for every period."""
    p = max(1, int(round(n_samples / max(int(merge_period), 1))))
    return min(p, int(min_rows)) if min_rows else p


def combine_nodes(comm, merged: Sequence, weight: float, backend=None) -> dict[str, Any]:
    """The cross-node step of a policy's merge: ``merged`` (this node's merged model, arrays on
    ``backend``) becomes the weighted mean over the nodes of ``comm``, in place.

    Returns loggable info (``node_weights``) for a multi-node run, ``{}`` otherwise.
    """
    if comm is None or comm.size == 1:
        return {}
    w = comm.combine(merged, float(weight), backend)
    total = float(w.sum())
    return {"node_weights": [float(x / total) if total > 0 else 1.0 / len(w) for x in w],
            "node_updates": [float(x) for x in w]}


# ------------------------------------------------------------------------------------ interface
class NodeComm:
    """What the trainer needs from the nodes of a run (one process per node).

    Attributes
    ----------
    rank, size : int
        This node's index and the number of nodes; rank 0 writes logs, checkpoints, the model.
    """

    rank = 0
    size = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def combine(self, arrays: Sequence, weight: float, backend=None) -> np.ndarray:
        """In place: ``arrays <- Σ_r weight_r arrays_r / Σ_r weight_r`` over the nodes.

        Parameters
        ----------
        arrays : list of arrays
            This node's merged model (float32, C-contiguous; host NumPy or CuPy on the merging
            device). Same shapes on every node.
        weight : float
            ``c_node``: this node's update count in the period (>= 0). When every node's weight is
            0 the mean is uniform.
        backend : optional
            The arrays' backend (unused by the host path).

        Returns
        -------
        numpy.ndarray of float64, shape (size,)
            Every node's weight, identical on every rank.
        """
        return np.array([float(weight)])

    def allreduce_sum(self, x: np.ndarray) -> np.ndarray:
        """Element-wise sum over the nodes of a host array (a new array)."""
        return np.array(x, copy=True)

    def allgather(self, x: np.ndarray) -> np.ndarray:
        """Host arrays of the same shape from every node, stacked: shape ``(size, *x.shape)``."""
        return np.asarray(x)[None].copy()

    def broadcast_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Overwrite every node's host ``arrays`` with rank 0's (in place; float32 or int64)."""

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every node."""
        return bytes(data or b"")

    def fail(self, exc: BaseException) -> NoReturn:
        """Stop the whole run because ``exc`` happened on this rank (never returns)."""
        raise exc

    def close(self) -> None:
        """Release the communicator (idempotent)."""


class LocalComm(NodeComm):
    """One process, one node: every collective is the identity (the default)."""


# ------------------------------------------------------------------------------------------ MPI
def _is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def _parse_fault(spec: str | None) -> tuple[int, int, str] | None:
    if not spec:
        return None
    parts = spec.strip().lower().split(":")
    if (len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit()
            or int(parts[1]) < 1 or parts[2] not in FAULT_MODES):
        raise ConfigError(f"XMC_MPI_FAULT={spec!r}: expected RANK:MERGE:MODE with MERGE >= 1 and "
                          f"MODE in {FAULT_MODES}, e.g. 1:3:raise")
    return int(parts[0]), int(parts[1]), parts[2]


class MPIComm(NodeComm):
    """The nodes of an ``mpiexec`` launch, over ``mpi4py`` (``MPI.COMM_WORLD`` by default).

    Parameters
    ----------
    comm : mpi4py communicator, optional
    timeout : float, optional
        Deadline of every collective in seconds (default ``XMC_COMM_TIMEOUT`` or 600).
    use_nccl : bool, optional
        NCCL for CuPy arrays: ``None`` = when ``cupy.cuda.nccl`` is available.

    Notes
    -----
    Every collective is non-blocking and polled against the deadline, so a node that dies or
    stalls stops the run (``MPI_Abort``) with a message instead of hanging it. The wait for the
    weights (the cross-node barrier: nodes arrive at different times) backs off to 1 ms sleeps so
    that a waiting rank leaves the CPU to a busy one; the model all-reduce that follows, with
    every rank present, is polled without sleeping.
    """

    def __init__(self, comm=None, *, timeout: float | None = None, use_nccl: bool | None = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise DistributedError(
                "a multi-node run needs mpi4py (and an MPI library): pip install "
                "'xmc-engine[mpi]' (installs mpi4py and mpich)") from exc
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        env_timeout = _env.comm_timeout()
        self.timeout = float(timeout if timeout is not None else
                             env_timeout if env_timeout is not None else DEFAULT_TIMEOUT)
        self.use_nccl = use_nccl
        self._nccl = None
        self.merges = 0
        self.fault = _parse_fault(_env.mpi_fault_spec())

    # -- collectives ---------------------------------------------------------------------------
    def combine(self, arrays: Sequence, weight: float, backend=None) -> np.ndarray:
        self.merges += 1
        self._maybe_fault()
        w = self._gather_weights(float(weight))
        total = float(w.sum())
        scale = float(weight) / total if total > 0 else 1.0 / self.size
        what = f"the model all-reduce of merge {self.merges}"
        if arrays and _is_cupy(arrays[0]):
            nccl = self._nccl_path()
            if nccl is not None:
                nccl.allreduce(arrays, scale, time.monotonic() + self.timeout,
                               lambda: self._timed_out(what, None))
                return w
            import cupy

            host = [cupy.asnumpy(a) for a in arrays]  # synchronize!
            self._allreduce_host(host, scale, what)
            for a, h in zip(arrays, host, strict=True):
                a.set(h)
            return w
        self._allreduce_host(list(arrays), scale, what)
        return w

    def allreduce_sum(self, x: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(np.array(x, copy=True))
        self._wait([self.comm.Iallreduce(self.MPI.IN_PLACE, out, op=self.MPI.SUM)],
                   "an all-reduce", spin=False)
        return out

    def allgather(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((self.size, *x.shape), dtype=x.dtype)
        self._wait([self.comm.Iallgather(x, out)], "an all-gather", spin=False)
        return out

    def broadcast_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        reqs = []
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError("broadcast_arrays needs C-contiguous arrays")
            reqs.append(self.comm.Ibcast(a, root=0))
        self._wait(reqs, "the broadcast of the initial model", spin=False)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        n = np.array([len(data) if (self.is_root and data) else 0], dtype=np.int64)
        self._wait([self.comm.Ibcast(n, root=0)], "a broadcast", spin=False)
        buf = (np.frombuffer(data, dtype=np.uint8).copy() if self.is_root and data
               else np.empty(int(n[0]), dtype=np.uint8))
        self._wait([self.comm.Ibcast(buf, root=0)], "a broadcast", spin=False)
        return buf.tobytes()

    # -- failure -------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> NoReturn:
        """Stop the job because ``exc`` happened here: rank 0 prints and aborts at once; another
        rank tells rank 0 (which prints the message naming it and aborts the job at its next
        collective) and aborts by itself if rank 0 has not done so within the deadline."""
        msg = f"{type(exc).__name__}: {exc}"
        if self.is_root:
            self._abort(f"rank 0 failed: {msg}; stopping all {self.size} ranks", EXIT_FAILED)
        print(f"xmc-engine: rank {self.rank}: error: {msg}", file=sys.stderr, flush=True)
        try:
            req = self.comm.isend(msg, dest=0, tag=_TAG_ERROR)
            deadline = time.monotonic() + min(self.timeout, 60.0)
            while time.monotonic() < deadline:
                req.Test()
                time.sleep(0.01)
        finally:
            self._abort(f"rank {self.rank} failed and rank 0 did not stop the job within the "
                        "deadline", EXIT_FAILED)

    def _abort(self, message: str, code: int) -> NoReturn:
        print(f"xmc-engine: error: {message}", file=sys.stderr, flush=True)
        logger.error("%s", message)
        # MPI_Abort kills every rank at once, and the launcher may drop what the ranks wrote
        # to stderr but it has not forwarded yet (seen: both ranks' messages lost): give it a
        # moment to forward them, so that the user learns which rank failed and why.
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
        os._exit(code)  # not reached

    def _check_errors(self) -> None:
        """Rank 0: a failure report from another rank stops the job with its message."""
        st = self.MPI.Status()
        if self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_TAG_ERROR, status=st):
            src = st.Get_source()
            msg = self.comm.recv(source=src, tag=_TAG_ERROR)
            self._abort(f"rank {src} of {self.size} failed: {msg}; stopping the run",
                        EXIT_FAILED)

    def _timed_out(self, what: str, missing: list[int] | None) -> NoReturn:
        who = (f"rank(s) {', '.join(map(str, missing))} did not reach merge {self.merges}"
               if missing else "a rank did not respond")
        self._abort(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s: {who} "
                    "(a node died or stalled; XMC_COMM_TIMEOUT sets the deadline); stopping all "
                    f"{self.size} ranks", EXIT_TIMEOUT)

    def _maybe_fault(self) -> None:
        if self.fault is None or self.fault[0] != self.rank or self.fault[1] != self.merges:
            return
        mode = self.fault[2]
        logger.warning("fault injection: rank %d %s at merge %d", self.rank, mode, self.merges)
        if mode == "exit":
            os._exit(1)
        if mode == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected failure of rank {self.rank} at merge {self.merges} "
                            "(XMC_MPI_FAULT)")

    # -- internals -----------------------------------------------------------------------------
    def _wait(self, reqs: list, what: str, *, spin: bool, pending=None) -> None:
        """Poll ``reqs`` until done; rank 0 watches for failure reports; abort at the deadline."""
        MPI = self.MPI
        deadline = time.monotonic() + self.timeout
        t_spin = time.monotonic() + (self.timeout if spin else 0.002)
        nap, polls = 0.0, 0
        while not MPI.Request.Testall(reqs):
            polls += 1
            if polls % 64 == 0 or not spin:
                now = time.monotonic()
                if self.is_root:
                    self._check_errors()
                if now > deadline:
                    self._timed_out(what, pending() if pending is not None else None)
                if now > t_spin:
                    nap = min(max(nap * 2, 1e-5), 1e-3)
                    time.sleep(nap)

    def _gather_weights(self, weight: float) -> np.ndarray:
        """Every node's weight on every rank; rank 0 learns which ranks are missing."""
        MPI = self.MPI
        mine = np.array([weight, self.merges], dtype=np.float64)
        got = np.zeros((self.size, 2), dtype=np.float64)
        if self.is_root:
            got[0] = mine
            reqs = [self.comm.Irecv(got[r], source=r, tag=_TAG_WEIGHT)
                    for r in range(1, self.size)]

            def pending():
                return [r + 1 for r, q in enumerate(reqs) if not q.Test()]

            self._wait(reqs, f"merge {self.merges}", spin=False, pending=pending)
            off = [r for r in range(self.size) if int(got[r, 1]) != self.merges]
            if off:
                self._abort(f"merge cadence out of step: rank(s) {off} are at merge(s) "
                            f"{[int(got[r, 1]) for r in off]}, rank 0 at {self.merges}",
                            EXIT_FAILED)
        else:
            self._wait([self.comm.Isend(mine, dest=0, tag=_TAG_WEIGHT)],
                       f"merge {self.merges} (sending to rank 0)", spin=False)
        w = np.ascontiguousarray(got[:, 0])
        self._wait([self.comm.Ibcast(w, root=0)], f"merge {self.merges} (weights from rank 0)",
                   spin=False)
        del MPI
        return w

    def _allreduce_host(self, arrays: list, scale: float, what: str) -> None:
        reqs, copies = [], []
        for a in arrays:
            buf = a if (a.flags.c_contiguous and a.dtype == np.float32) else \
                np.ascontiguousarray(a, dtype=np.float32)
            buf *= np.float32(scale)
            copies.append((a, buf))
            reqs.append(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))
        self._wait(reqs, what, spin=True)
        for a, buf in copies:
            if buf is not a:
                a[...] = buf

    def _nccl_path(self):
        if self._nccl is None:
            self._nccl = False
            if self.use_nccl is not False:
                try:
                    from cupy.cuda import nccl

                    ok = bool(getattr(nccl, "available", True))
                except Exception:  # noqa: BLE001 - no NCCL in this CuPy build
                    ok = False
                # Every rank must agree, or the NCCL set-up would hang half the nodes.
                ok_all = self.allgather(np.array([ok], dtype=np.int8))
                if ok_all.all():
                    self._nccl = _NcclAllreduce(self)
                elif self.use_nccl:
                    raise DistributedError("use_nccl=True but cupy.cuda.nccl is not available "
                                           "on every rank")
        return self._nccl or None

    def close(self) -> None:
        self._nccl = None


class _NcclAllreduce:
    """CuPy's NCCL communicator for the model all-reduce (one GPU per rank, in place, on the
    current stream); the unique id is broadcast over MPI."""

    def __init__(self, mpi: MPIComm):
        from cupy.cuda import nccl

        self.nccl = nccl
        uid = nccl.get_unique_id() if mpi.is_root else None
        uid = pickle.loads(mpi.broadcast_bytes(pickle.dumps(uid) if mpi.is_root else None))
        self.comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        logger.info("rank %d: NCCL communicator for the model all-reduce", mpi.rank)

    def allreduce(self, arrays: Sequence, scale: float, deadline: float, on_timeout) -> None:
        import cupy

        nccl = self.nccl
        stream = cupy.cuda.get_current_stream()
        for a in arrays:
            a *= scale
            self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                stream.ptr)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(stream)
        while not done.done:
            if time.monotonic() > deadline:
                self.comm.abort()
                on_timeout()
            time.sleep(1e-5)


# ------------------------------------------------------------------------------------ the world
_WORLD: NodeComm = LocalComm()


def init(distributed: bool | None = None, *, timeout: float | None = None) -> NodeComm:
    """Set up this process's communicator and return it (also :func:`world` from then on).

    ``distributed=None`` detects an MPI launch from the launcher's environment
    (:func:`xmc_engine._env.mpi_launch`: ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ...) and uses
    MPI when it started more than one process; ``True`` forces MPI, ``False`` one process.
    """
    global _WORLD
    if distributed is None:
        launch = _env.mpi_launch()
        distributed = launch is not None and launch[1] > 1
    _WORLD = MPIComm(timeout=timeout) if distributed else LocalComm()
    return _WORLD


def world() -> NodeComm:
    """The communicator set by :func:`init` (a :class:`LocalComm` before)."""
    return _WORLD


def node_queue(comm: NodeComm, policy, n_local: int, n_devices: int, period: int, *,
               assignment: str = "shared", seed: int = 0):
    """The batch queue of one node of a multi-node run (collective: every rank calls it once).

    Cuts every rank's epoch into the same number ``P`` of merge periods
    (:func:`periods_per_epoch` of the global rows and the global period ``period``, the
    longest any rank asks for: an ``'auto'`` period follows the devices, which nodes need not
    share), so that every rank merges equally often; the node's own period is
    ``S_r = ceil(n_r / P)``.
    ``assignment="fixed"`` gives a :class:`~xmc_engine.scheduler.queue.FixedAssignmentQueue`
    (deterministic mode; devices numbered globally across ranks).

    Returns ``(queue, S_r, n_global)``.
    """
    from xmc_engine.scheduler.queue import BatchQueue, FixedAssignmentQueue

    if assignment not in ("shared", "fixed"):
        raise ConfigError(f"assignment must be 'shared' or 'fixed', got {assignment!r}")
    if not policy.supports_nodes:
        raise ConfigError(f"algorithm {policy.name!r} cannot run across nodes; use 'adaptive' "
                          "or 'average'")
    sizes = comm.allgather(np.array([n_local, n_devices, period], dtype=np.int64))
    n_global = int(sizes[:, 0].sum())
    S = int(sizes[:, 2].max())
    if assignment == "fixed":
        first = int(sizes[:comm.rank, 1].sum())
        starts = [i * n_local // n_devices for i in range(n_devices + 1)]
        counts = [starts[i + 1] - starts[i] for i in range(n_devices)]
        all_counts = [(j * int(m) // int(d), ((j + 1) * int(m)) // int(d))
                      for m, d, _ in sizes for j in range(int(d))]
        P = periods_per_epoch(n_global, S, min(b - a for a, b in all_counts))
        queue = FixedAssignmentQueue(starts[:-1], counts, range(first, first + n_devices), P,
                                     seed=seed)
    else:
        P = periods_per_epoch(n_global, S, int(sizes[:, 0].min()))
        queue = BatchQueue(n_local, n_devices, S, seed=seed, static=policy.static)
        queue.n_periods = P
    local = max(1, -(-n_local // P))
    queue.merge_period = local
    if comm.is_root:
        logger.info("%d node(s), %d rows: %d merge periods per epoch (S = %d global, %d on "
                    "rank 0)", comm.size, n_global, P, S, local)
    return queue, local, n_global


def join_run(comm: NodeComm, cfg, params: Sequence[np.ndarray], label_counts: np.ndarray,
             n_samples: int, resume: bool) -> tuple[np.ndarray, int]:
    """Start of a multi-node run (collective): check the config, give every rank rank 0's
    initial model (in place) and return the global ``(label_counts, n_samples)``."""
    if cfg.algorithm not in ("adaptive", "average"):
        raise ConfigError(f"algorithm={cfg.algorithm!r} cannot run across {comm.size} MPI ranks; "
                          "use --algorithm adaptive (or average)")
    if resume:
        raise ConfigError("resuming a multi-node run is not supported yet; resume it in one "
                          "process (xmc-engine train --resume RUN_DIR) or start over")
    bufs = [np.ascontiguousarray(p) for p in params]
    comm.broadcast_arrays(bufs)
    for p, b in zip(params, bufs, strict=True):
        if b is not p:
            p[...] = b
    counts = comm.allreduce_sum(np.asarray(label_counts, dtype=np.float64))
    n = int(comm.allreduce_sum(np.array([n_samples], dtype=np.int64))[0])
    return counts, n
