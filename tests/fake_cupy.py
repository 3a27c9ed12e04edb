"""A NumPy-backed stand-in for the part of CuPy that :class:`~xmc_engine.backends.cuda.CUDABackend`
uses, so that the backend's own orchestration (devices, streams, events, peer access, pool
allocation, transfers) runs without a GPU.

Arrays are :class:`FakeArray` (a NumPy subclass that knows its device); work runs eagerly on the
host, and a :class:`Ledger` records, for every buffer, which stream last wrote it and which
streams read it since, so that it can name each **hazard**: a stream touching a buffer another
stream wrote (or read, for a write) without having waited on an event recorded after that access,
and without the host having synchronised that stream since. It also records device work done on
the legacy null stream (outside any stream context: the arena a worker must not allocate from),
device reads from the host of a value whose stream was not synchronised, and accesses to another
device's memory without enabled peer access.

Kernels: ``numba.cuda`` kernels need a real GPU or the simulator, which has to be switched on
before numba is imported (a separate process, ``tests/test_kernels_cuda.py``). Here the backend's
``launch`` hook runs NumPy versions of the launchers instead (:func:`launch`), written from
:mod:`xmc_engine.kernels.reference`; :data:`KERNELS` names the arguments each launch writes.

Use: :func:`install` (a pytest fixture wraps it) puts the stand-in into ``sys.modules`` as
``cupy``, ``cupy.cuda``, ``cupy.cublas`` and ``cupyx.scipy.sparse``.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from dataclasses import dataclass, field

import numpy as np
from xmc_engine.kernels import reference


# ------------------------------------------------------------------------------- the ledger
@dataclass
class Event:
    stream: FakeStream
    seq: int

    def synchronize(self):
        """The host waits for the work queued on the stream before the event."""
        LEDGER.calls.append(("event.synchronize", self.stream, self.seq))
        LEDGER.synced[self.stream] = max(LEDGER.synced.get(self.stream, 0), self.seq)


@dataclass
class Access:
    stream: FakeStream
    seq: int


@dataclass
class BufferState:
    write: Access | None = None
    reads: list = field(default_factory=list)


class Ledger:
    """Stream/event calls and the hazards they leave (module docstring)."""

    def __init__(self, n_devices: int = 2, peer: bool = True):
        self.n_devices = n_devices
        self.can_access_peer = peer
        self.peer_enabled: set[tuple[int, int]] = set()
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self.buffers: dict[int, tuple[np.ndarray, BufferState]] = {}
        self.waited: dict[FakeStream, dict[FakeStream, int]] = {}
        self.synced: dict[FakeStream, int] = {}
        self.calls: list[tuple] = []
        self.hazards: list[str] = []
        self.null_stream_ops: list[str] = []
        self.launches: list[str] = []

    def next(self) -> int:
        return next(self._seq)

    def ordered(self, stream: FakeStream, acc: Access) -> bool:
        """Whether work queued now on ``stream`` runs after the access ``acc``."""
        if acc.stream is stream:
            return True
        return (self.waited.get(stream, {}).get(acc.stream, 0) >= acc.seq
                or self.synced.get(acc.stream, 0) >= acc.seq)

    def touch(self, arrays, write: bool, what: str, stream: FakeStream | None = None):
        """Record that ``stream`` (default: the current one) reads or writes ``arrays``."""
        stream = stream or current_stream()
        dev = current_device()
        with self._lock:
            for a in arrays:
                if not isinstance(a, FakeArray):
                    continue
                if stream.null:
                    self.null_stream_ops.append(what)
                if a.device_id != dev and (dev, a.device_id) not in self.peer_enabled:
                    self.hazards.append(f"{what}: device {dev} reads device {a.device_id}'s "
                                        "memory without peer access")
                root = _root(a)
                _, st = self.buffers.setdefault(id(root), (root, BufferState()))
                before = ([st.write] if st.write else []) + (st.reads if write else [])
                for acc in before:
                    if not self.ordered(stream, acc):
                        self.hazards.append(
                            f"{what}: {stream} {'writes' if write else 'reads'} a buffer "
                            f"{acc.stream} accessed at #{acc.seq} without waiting for it")
                        break
                now = Access(stream, self.next())
                if write:
                    st.write, st.reads = now, []
                else:
                    st.reads.append(now)

    def host_read(self, a: FakeArray, what: str):
        """The host reads ``a``: its last writer must have been synchronised."""
        with self._lock:
            entry = self.buffers.get(id(_root(a)))
            acc = entry[1].write if entry else None
            if acc is not None and self.synced.get(acc.stream, 0) < acc.seq:
                self.hazards.append(f"{what}: host reads a value {acc.stream} wrote at "
                                    f"#{acc.seq} before synchronising it")


LEDGER = Ledger()
_tls = threading.local()


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _stack(name, default):
    s = getattr(_tls, name, None)
    if s is None:
        s = [default]
        setattr(_tls, name, s)
    return s


def current_device() -> int:
    return _stack("devices", 0)[-1]


def current_stream() -> FakeStream:
    dev = current_device()
    streams = [s for s in _stack("streams", None)[1:] if s.device_id == dev]
    return streams[-1] if streams else NULL_STREAMS[dev]


# ------------------------------------------------------------------------------- cupy.cuda
class Device:
    """``cupy.cuda.Device(i)``: a context manager making device ``i`` current in this thread."""

    def __init__(self, device_id: int = 0):
        self.id = int(device_id)

    def __enter__(self):
        _stack("devices", 0).append(self.id)
        return self

    def __exit__(self, *exc):
        _stack("devices", 0).pop()

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)


class FakeStream:
    """``cupy.cuda.Stream``: belongs to the device current at creation."""

    _ids = itertools.count()

    def __init__(self, non_blocking: bool = False, *, null: bool = False, device_id=None):
        self.device_id = current_device() if device_id is None else device_id
        self.null = null
        self.ptr = 0 if null else 1000 + next(self._ids)
        self.non_blocking = non_blocking

    def __repr__(self):
        return f"<stream {'null' if self.null else self.ptr} on device {self.device_id}>"

    def __enter__(self):
        _stack("streams", None).append(self)
        return self

    def __exit__(self, *exc):
        _stack("streams", None).pop()

    def synchronize(self):
        LEDGER.calls.append(("synchronize", self))
        LEDGER.synced[self] = LEDGER.next()

    def record(self, event=None):
        if current_device() != self.device_id:
            raise RuntimeError(f"{self}: event recorded with device {current_device()} current")
        ev = Event(self, LEDGER.next())
        LEDGER.calls.append(("record", self, ev.seq))
        return ev

    def wait_event(self, event: Event):
        LEDGER.calls.append(("wait", self, event.stream, event.seq))
        w = LEDGER.waited.setdefault(self, {})
        w[event.stream] = max(w.get(event.stream, 0), event.seq)


NULL_STREAMS: dict[int, FakeStream] = {}


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int):
        super().__init__(f"CUDA runtime error {status}")
        self.status = status


def _device_can_access_peer(device: int, peer: int) -> int:
    LEDGER.calls.append(("deviceCanAccessPeer", device, peer))
    return int(LEDGER.can_access_peer and device != peer)


def _device_enable_peer_access(peer: int) -> None:
    dev = current_device()
    LEDGER.calls.append(("deviceEnablePeerAccess", dev, peer))
    if (dev, peer) in LEDGER.peer_enabled:
        raise CUDARuntimeError(704)
    LEDGER.peer_enabled.add((dev, peer))


runtime = types.SimpleNamespace(
    deviceCanAccessPeer=_device_can_access_peer,
    deviceEnablePeerAccess=_device_enable_peer_access,
    getDeviceCount=lambda: LEDGER.n_devices,
    CUDARuntimeError=CUDARuntimeError,
)


# ------------------------------------------------------------------------------- arrays
def _plain(x):
    if isinstance(x, FakeArray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _fakes(x):
    if isinstance(x, FakeArray):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in _fakes(v)]
    return []


def _wrap(r, device_id=None):
    if isinstance(r, FakeArray):
        return r
    if isinstance(r, np.ndarray):
        out = r.view(FakeArray)
        out.device_id = current_device() if device_id is None else device_id
        return out
    if isinstance(r, np.generic):
        return _wrap(np.asarray(r), device_id)
    if isinstance(r, tuple):
        return tuple(_wrap(v, device_id) for v in r)
    return r


def _produced(r, what):
    """Wrap a new result and record it as written by the current stream (fresh device
    memory from the current stream's pool arena)."""
    r = _wrap(r)
    LEDGER.touch(_fakes(r), True, what)
    return r


class MemoryPointer:
    """``ndarray.data``: what ``copy_from_device_async`` needs."""

    def __init__(self, array):
        self.array = array

    def copy_from_device_async(self, src, size, stream=None):
        dst, s = self.array, stream or current_stream()
        LEDGER.touch([src.array], False, "copy_from_device_async (peer)", s)
        LEDGER.touch([dst], True, "copy_from_device_async (peer)", s)
        if (dst.device_id, src.array.device_id) not in LEDGER.peer_enabled \
                and dst.device_id != src.array.device_id:
            LEDGER.hazards.append("peer copy without enabled peer access")
        np.copyto(dst.view(np.ndarray), src.array.view(np.ndarray))


class FakeArray(np.ndarray):
    """A device array: NumPy memory, a device id, accesses recorded in :data:`LEDGER`."""

    device_id = 0

    def __array_finalize__(self, obj):
        self.device_id = getattr(obj, "device_id", current_device())

    @property
    def device(self):
        return Device(self.device_id)

    @property
    def data(self):
        return MemoryPointer(self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out", ())
        what = f"{ufunc.__name__}.{method}"
        LEDGER.touch(_fakes(inputs), False, what)
        LEDGER.touch(_fakes(outs), True, what)
        if outs:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        r = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        if outs:
            return outs[0] if len(outs) == 1 else outs
        return _produced(r, what)

    def __array_function__(self, func, types_, args, kwargs):
        what = func.__name__
        if func is np.copyto:
            LEDGER.touch(_fakes(args[1:]), False, what)
            LEDGER.touch(_fakes(args[:1]), True, what)
        else:
            LEDGER.touch(_fakes(args) + _fakes(list(kwargs.values())), False, what)
        r = func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
        return _produced(r, what)

    def __getitem__(self, key):
        gather = any(isinstance(k, (np.ndarray, list)) for k in
                     (key if isinstance(key, tuple) else (key,)))
        if gather:
            LEDGER.touch([self] + _fakes(key), False, "gather")
            return _wrap(self.view(np.ndarray)[_plain(key)].copy(), self.device_id)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        LEDGER.touch(_fakes(value) + _fakes(key), False, "setitem")
        LEDGER.touch([self], True, "setitem")
        self.view(np.ndarray)[_plain(key)] = _plain(value)

    def astype(self, dtype, copy=True):
        LEDGER.touch([self], False, "astype")
        return _wrap(self.view(np.ndarray).astype(dtype), self.device_id)

    def copy(self, order="C"):
        LEDGER.touch([self], False, "copy")
        return _wrap(self.view(np.ndarray).copy(order), self.device_id)

    def get(self, stream=None):
        LEDGER.touch([self], False, "get", stream or current_stream())
        if stream is None:  # CuPy: synchronous on the current stream
            current_stream().synchronize()
        return np.array(self.view(np.ndarray))

    def set(self, arr, stream=None):
        LEDGER.touch([self], True, "set", stream or current_stream())
        np.copyto(self.view(np.ndarray), arr)

    def _host_scalar(self, what):
        LEDGER.host_read(self, what)
        return self.view(np.ndarray)

    def __float__(self):
        return float(self._host_scalar("float()"))

    def __int__(self):
        return int(self._host_scalar("int()"))

    def __bool__(self):
        return bool(self._host_scalar("bool()"))


def _new(shape, dtype, fill=None):
    a = _wrap(np.empty(shape, dtype))
    LEDGER.touch([a], True, "allocate")
    if fill is not None:
        a.view(np.ndarray).fill(fill)
    return a


def empty(shape, dtype=np.float64):
    return _new(shape, dtype)


def zeros(shape, dtype=np.float64):
    return _new(shape, dtype, 0)


def full(shape, fill_value, dtype=None):
    return _new(shape, dtype or np.asarray(fill_value).dtype, fill_value)


def empty_like(a, dtype=None):
    return _new(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None):
    return _new(a.shape, dtype or a.dtype, 0)


def asarray(a, dtype=None):
    if isinstance(a, FakeArray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    out = _new(host.shape, host.dtype)
    np.copyto(out.view(np.ndarray), host)
    return out


def array(a, dtype=None, copy=True):
    if isinstance(a, FakeArray):
        return a.astype(dtype or a.dtype) if copy else asarray(a, dtype)
    return asarray(a, dtype)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def is_available() -> bool:
    return True


# ------------------------------------------------------------------------------- cuBLAS
def _gemm(transa, transb, a, b, out=None, alpha=1.0, beta=0.0):
    A = a.T if transa == "T" else a
    Bm = b.T if transb == "T" else b
    LEDGER.touch([a, b], False, "cublas.gemm")
    LEDGER.touch([out], True, "cublas.gemm")
    o = out.view(np.ndarray)
    o[...] = alpha * (A.view(np.ndarray) @ Bm.view(np.ndarray)) + beta * o
    return out


# ------------------------------------------------------------------------------- kernels
def _csr_rows(indptr):
    return np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))


def _softmax_xent(Z, y_indptr, y_indices, scale, loss_rows, work, colsum, bias=None):
    if bias is not None:
        Z += bias
    dZ, _ = reference.softmax_xent(Z, y_indptr, y_indices, scale)
    loss_rows[...] = reference.softmax_xent_loss_rows(Z.astype(np.float64), y_indptr, y_indices)
    Z[...] = dZ
    if colsum is not None:
        colsum += dZ.sum(axis=0)


def _bce(Z, bias, use_bias, c0, colw, y_indptr, y_indices, scale, loss_sum, colsum):
    """``bce_launch``: the reference on the chunk's own labels (ids renumbered from ``c0``)."""
    if use_bias:
        Z += bias
    rows, labs = _csr_rows(y_indptr), y_indices - c0
    inside = (labs >= 0) & (labs < Z.shape[1])
    counts = np.bincount(rows[inside], minlength=Z.shape[0])
    local_ptr = np.concatenate([[0], np.cumsum(counts)])
    has = np.diff(y_indptr) > 0  # a row with labels outside the chunk still has labels
    w = colw if len(colw) else np.ones(Z.shape[1])
    Y = reference.label_targets(local_ptr, labs[inside], Z.shape[1]) > 0
    Z64 = Z.astype(np.float64)
    dZ = (scale * w * (1.0 / (1.0 + np.exp(-Z64)) - Y) * has[:, None]).astype(Z.dtype)
    loss_sum += ((np.logaddexp(0.0, Z64) - Y * Z64) * w).sum(axis=1)[has].sum()
    Z[...] = dZ
    colsum += dZ.sum(axis=0)


def _chunk_stats(Zc, bias_c, c0, y_indptr, y_indices, m, s, ysum):
    Zc += bias_c
    rows, labs = _csr_rows(y_indptr), y_indices - c0
    inside = (labs >= 0) & (labs < Zc.shape[1])
    np.add.at(ysum, rows[inside], Zc[rows[inside], labs[inside]])
    mc = np.maximum(Zc.max(axis=1), m)
    s[...] = s * np.exp(m - mc) + np.exp(Zc - mc[:, None]).sum(axis=1)
    m[...] = mc


def _chunk_grad(Zc, bias_c, c0, y_indptr, y_indices, lse, scale):
    ny = np.diff(y_indptr)
    Zc[...] = np.where(ny[:, None] > 0, scale * np.exp(Zc + bias_c - lse[:, None]), 0)
    rows, labs = _csr_rows(y_indptr), y_indices - c0
    inside = (labs >= 0) & (labs < Zc.shape[1])
    np.subtract.at(Zc, (rows[inside], labs[inside]), (scale / ny[rows])[inside])


def _sparse_grad(indptr, inv, data, dZ1, grad_rows, grad_b1):
    np.add.at(grad_rows, inv, data[:, None] * dZ1[_csr_rows(indptr)])
    grad_b1 += dZ1.sum(axis=0)


def _topk_merge(ia, va, ib, vb, io, vo):
    i = np.concatenate([ia, ib], axis=1)
    v = np.concatenate([va, vb], axis=1)
    order = np.lexsort((i, -v), axis=1)[:, : io.shape[1]] if i.shape[1] else i
    io[...] = np.take_along_axis(i, order, axis=1)
    vo[...] = np.take_along_axis(v, order, axis=1)


def _adagrad_rows(W, rows, grad_rows, acc_W, lr, eps):
    W_new, acc_new = reference.adagrad_rows(W, rows, grad_rows, acc_W, lr, eps)
    W[rows], acc_W[rows] = W_new[rows], acc_new[rows]


def _assign(*targets):
    def put(results):
        for t, r in zip(targets, results, strict=True):
            t[...] = r
    return put


#: launcher name -> (NumPy version, positions of the arguments it writes; the others are read)
KERNELS = {
    "sparse_forward_launch": (lambda ip, ix, d, W1, b1, out: _assign(out)(
        [reference.sparse_forward(ip, ix, d, W1, b1)]), (5,)),
    "sparse_backward_update_launch": (lambda ip, ix, d, dZ1, W1, b1, lr: _assign(W1, b1)(
        reference.sparse_backward_update(ip, ix, d, dZ1, W1, b1, lr)), (4, 5)),
    "sparse_grad_launch": (_sparse_grad, (4, 5)),
    "sparse_rows_update_launch": (lambda W1, rows, g, lr: _assign(W1)(
        [reference.sparse_rows_update(W1, rows, g, lr)]), (0,)),
    "relu_backward_launch": (lambda dH, H: _assign(dH)([reference.relu_backward(dH, H)]), (0,)),
    "column_sum_launch": (lambda Z, out, alpha: _assign(out)([out + alpha * Z.sum(axis=0)]),
                          (1,)),
    "softmax_xent_launch": (_softmax_xent, (0, 4, 5, 6)),
    "softmax_rowblock_launch": (lambda Z, yp, yi, scale, loss_rows, bias=None: _softmax_xent(
        Z, yp, yi, scale, loss_rows, None, None, bias=bias), (0, 4)),
    "bce_launch": (_bce, (0, 8, 9)),
    "softmax_chunk_stats_launch": (_chunk_stats, (0, 5, 6, 7)),
    "softmax_chunk_grad_launch": (_chunk_grad, (0,)),
    "topk_launch": (lambda sc, k, ci, cv, idx, val: _assign(idx, val)(reference.topk(sc, k)),
                    (2, 3, 4, 5)),
    "topk_merge_launch": (_topk_merge, (4, 5)),
    "weighted_sum_launch": (lambda arrays, w, out: _assign(out)(
        [reference.weighted_sum(arrays, w)]), (2,)),
    "momentum_launch": (lambda wb, z1, z2, mu, out: _assign(out)(
        [reference.momentum(wb, z1, z2, mu)]), (4,)),
    "elastic_launch": (lambda x, c, alpha, diff: _assign(x, diff)(reference.elastic(x, c, alpha)),
                       (0, 3)),
    "adagrad_dense_launch": (lambda w, g, acc, lr, eps: _assign(w, acc)(
        reference.adagrad_dense(w, g, acc, lr, eps)), (0, 2)),
    "adagrad_rows_launch": (_adagrad_rows, (0, 3)),
    "gather_columns_launch": (lambda W2, b2, cols, W2s, b2s: _assign(W2s, b2s)(
        reference.gather_columns(W2, b2, cols)), (3, 4)),
    "scatter_add_columns_launch": (lambda W2, b2, cols, dW2s, db2s, alpha: _assign(W2, b2)(
        reference.scatter_add_columns(W2, b2, cols, dW2s, db2s, alpha)), (0, 1)),
    "adagrad_columns_launch": (lambda W2, b2, aW, ab, cols, dW2s, db2s, lr, eps: _assign(
        W2, b2, aW, ab)(reference.adagrad_columns(W2, b2, aW, ab, cols, dW2s, db2s, lr, eps)),
        (0, 1, 2, 3)),
}


def launch(launcher, *args, **kwargs):
    """The ``launch`` hook of a :class:`CUDABackend` over the stand-in: the NumPy version of
    ``launcher`` on host memory, recorded as reads and writes on the current stream."""
    name = launcher.__name__
    fn, written = KERNELS[name]
    LEDGER.launches.append(name)
    reads = [a for k, a in enumerate(args) if k not in written] + list(kwargs.values())
    LEDGER.touch(_fakes(reads), False, name)
    LEDGER.touch(_fakes([args[k] for k in written]), True, name)
    fn(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})


# ------------------------------------------------------------------------------- installing
def install(monkeypatch, n_devices: int = 2, peer: bool = True) -> Ledger:
    """Put the stand-in into ``sys.modules`` (undone by ``monkeypatch``); returns a fresh ledger."""
    global LEDGER
    LEDGER = Ledger(n_devices, peer)
    NULL_STREAMS.clear()
    NULL_STREAMS.update({d: FakeStream(null=True, device_id=d) for d in range(n_devices)})
    _tls.__dict__.clear()

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Stream, cuda.runtime = Device, FakeStream, runtime
    # milliseconds between two events of one stream: a stand-in count of the calls between them
    cuda.get_elapsed_time = lambda start, stop: float(stop.seq - start.seq)
    cuda.alloc_pinned_memory = bytearray  # page-locked host memory: plain bytes here
    cublas = types.ModuleType("cupy.cublas")
    cublas.gemm = _gemm
    cupy = types.ModuleType("cupy")
    this = sys.modules[__name__]
    for name in ("empty", "zeros", "full", "empty_like", "zeros_like", "asarray", "array",
                 "ascontiguousarray", "is_available"):
        setattr(cupy, name, getattr(this, name))
    cupy.ndarray, cupy.cuda, cupy.cublas = FakeArray, cuda, cublas
    cupy.__getattr__ = lambda name: getattr(np, name)  # everything else: NumPy's, dispatched
    sparse = types.ModuleType("cupyx.scipy.sparse")
    scipy_ = types.ModuleType("cupyx.scipy")
    scipy_.sparse = sparse
    cupyx = types.ModuleType("cupyx")
    cupyx.scipy = scipy_
    for name, mod in [("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cublas", cublas),
                      ("cupyx", cupyx), ("cupyx.scipy", scipy_), ("cupyx.scipy.sparse", sparse)]:
        monkeypatch.setitem(sys.modules, name, mod)
    return LEDGER
