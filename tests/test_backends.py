"""Backend objects: the declared protocol (backends/base.py), on every available backend."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest
import scipy.sparse as sps
from xmc_engine.kernels import reference

from xmc_engine.backends import Backend, SchedulerBackend, get_backend
from xmc_engine.scheduler.replica import HostBackend

F32 = np.float32

def protocol_members(proto):
    """``(attributes, methods)`` a Protocol class declares, its Protocol bases included."""
    attrs, methods = set(), {}
    for cls in reversed(proto.__mro__):
        if cls is typing.Protocol or typing.Protocol not in cls.__mro__:
            continue
        attrs |= set(cls.__dict__.get("__annotations__", {}))
        methods.update({k: v for k, v in vars(cls).items()
                        if callable(v) and not k.startswith("_")})
    return attrs, methods


def declared(cls, name):
    """Whether ``cls`` defines ``name`` as a class attribute or annotates it (set per object)."""
    return any(name in vars(c) or name in vars(c).get("__annotations__", {}) for c in cls.__mro__)


def check_implements(cls, proto):
    """Every attribute and method of ``proto`` on ``cls``, the methods with the same parameters:
    names, kinds and defaults, in order (``self`` aside: a staticmethod matches a method)."""
    attrs, methods = protocol_members(proto)
    missing = sorted(a for a in attrs if not declared(cls, a))
    assert not missing, f"{cls.__name__} lacks attributes {missing} of {proto.__name__}"
    for name, fn in methods.items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {proto.__name__}.{name}"

        def params(f):
            return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()
                    if p.name != "self"]

        assert params(getattr(cls, name)) == params(fn), f"{cls.__name__}.{name}"


def test_protocols_declare_what_the_engine_calls():
    attrs, methods = protocol_members(Backend)
    assert {"name", "xp", "sp", "device_id", "threads", "tracks_rows"} <= attrs
    assert {"activate", "thread_budget", "synchronize", "fence", "to_float", "all_finite",
            "merge_rows", "copy_rows", "gemm_acc", "output_layer_step", "topk"} <= set(methods)
    s_attrs, s_methods = protocol_members(SchedulerBackend)
    assert s_attrs < attrs and set(s_methods) < set(methods)


def test_cpu_backend_implements_the_whole_protocol():
    from xmc_engine.backends.cpu import CPUBackend

    check_implements(CPUBackend, Backend)
    assert isinstance(CPUBackend(), Backend)


def test_cuda_backend_implements_the_whole_protocol():
    """Checked on the class: ``backends.cuda`` imports without CuPy (it imports CuPy only when
    a backend is constructed)."""
    from xmc_engine.backends.cuda import CUDABackend

    check_implements(CUDABackend, Backend)
    assert CUDABackend.threads is None and CUDABackend.tracks_rows is False


def test_host_backend_implements_the_scheduler_part():
    check_implements(HostBackend, SchedulerBackend)
    assert isinstance(HostBackend(), SchedulerBackend)


def test_mirror_check_catches_a_renamed_parameter_or_default():
    class Bad:
        def synchronize(self):
            pass

    class Proto(typing.Protocol):
        def synchronize(self, timeout=1.0):
            ...

    with pytest.raises(AssertionError, match="Bad.synchronize"):
        check_implements(Bad, Proto)


def test_capability_flags_are_plain_booleans(backend_name):
    be = get_backend(backend_name)
    assert isinstance(be.tracks_rows, bool)
    assert be.threads is None or be.threads >= 1


def test_attributes(backend_name):
    be = get_backend(backend_name)
    assert be.name == backend_name
    assert be.xp.__name__ in ("numpy", "cupy")
    assert (be.device_id is None) == (backend_name == "cpu")


def test_training_like_round_trip(backend_name):
    """forward -> output step -> relu backward -> sparse update, against the reference."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(0)
    B, F, nh, L = 9, 40, 8, 25
    X = sps.random(B, F, density=0.2, format="csr", dtype=F32, random_state=1)
    Y = sps.random(B, L, density=0.1, format="csr", dtype=F32, random_state=2)
    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = np.zeros(nh, F32)
    W2 = (rng.standard_normal((nh, L)) * 0.1).astype(F32)
    b2 = np.zeros(L, F32)
    ip, ix, d = be.csr_parts(X)
    yp, yi = be.asarray(Y.indptr), be.asarray(Y.indices)
    dW1, db1, dW2, db2 = (be.asarray(a.copy()) for a in (W1, b1, W2, b2))
    H = be.zeros((B, nh))
    be.sparse_forward(ip, ix, d, dW1, db1, H)
    dH = be.empty((B, nh))
    loss = be.output_layer_step(H, dW2, db2, yp, yi, 0.1, dH)
    be.relu_backward(dH, H)
    be.sparse_backward_update(ip, ix, d, dH, dW1, db1, 0.1)
    be.synchronize()

    Hr = reference.sparse_forward(X.indptr, X.indices, X.data, W1, b1)
    loss_r, W2r, b2r, dHr = reference.output_layer_step(Hr, W2, b2, Y.indptr, Y.indices, 0.1)
    dHr = reference.relu_backward(dHr, Hr)
    W1r, b1r = reference.sparse_backward_update(X.indptr, X.indices, X.data, dHr, W1, b1, 0.1)
    assert float(loss) == pytest.approx(loss_r, rel=1e-5)
    for got, want in [(H, Hr), (dW2, W2r), (db2, b2r), (dW1, W1r), (db1, b1r)]:
        np.testing.assert_allclose(be.to_host(got), want, atol=1e-5)


def test_sparse_grad_then_rows_update(backend_name):
    be = get_backend(backend_name)
    rng = np.random.default_rng(1)
    X = sps.random(6, 30, density=0.2, format="csr", dtype=F32, random_state=3)
    dZ1 = rng.standard_normal((6, 4)).astype(F32)
    W1 = rng.standard_normal((30, 4)).astype(F32)
    rows, g, gb = be.sparse_grad(*be.csr_parts(X), be.asarray(dZ1))
    Wd = be.asarray(W1.copy())
    be.sparse_rows_update(Wd, rows, g, 0.5)
    r_rows, r_g, r_gb = reference.sparse_grad(X.indptr, X.indices, X.data, dZ1)
    np.testing.assert_array_equal(be.to_host(rows), r_rows)
    np.testing.assert_allclose(be.to_host(g), r_g, atol=1e-5)
    np.testing.assert_allclose(be.to_host(gb), r_gb, atol=1e-5)
    np.testing.assert_allclose(be.to_host(Wd), reference.sparse_rows_update(W1, r_rows, r_g, 0.5),
                               atol=1e-5)


def test_topk_merge_ops_and_copies(backend_name):
    be = get_backend(backend_name)
    rng = np.random.default_rng(2)
    s = rng.standard_normal((5, 40)).astype(F32)
    idx, val = be.topk(be.asarray(s), 3)
    ir, vr = reference.topk(s, 3)
    np.testing.assert_array_equal(be.to_host(idx), ir)
    np.testing.assert_array_equal(be.to_host(val), vr)
    a, b = be.asarray(s.copy()), be.asarray(s * 2)
    out = be.empty(s.shape)
    be.weighted_sum([a, b], [0.25, 0.75], out)
    np.testing.assert_allclose(be.to_host(out), 1.75 * s, rtol=1e-6)
    be.momentum(a, b, a, 0.5, out)
    np.testing.assert_allclose(be.to_host(out), s + 0.5 * s, rtol=1e-6)
    diff = be.empty(s.shape)
    be.elastic(b, a, 0.5, diff)
    np.testing.assert_allclose(be.to_host(diff), 0.5 * s, rtol=1e-6)
    np.testing.assert_allclose(be.to_host(b), 1.5 * s, rtol=1e-6)
    c = be.zeros(s.shape)
    be.copy_into(c, a)
    np.testing.assert_array_equal(be.to_host(c), s)


def test_upload_returns_equal_arrays(backend_name):
    be = get_backend(backend_name)
    arrays = [np.arange(5, dtype=np.int64), np.ones(3, F32), np.zeros(0, np.int32)]
    out = be.upload(arrays)
    for got, want in zip(out, arrays, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(be.to_host(got), want)


def test_cpu_thread_budget_is_per_thread():
    import threading

    import numba

    be = get_backend("cpu")
    seen = {}

    def worker():
        with be.thread_budget(1):
            seen["inner"] = numba.get_num_threads()

    before = numba.get_num_threads()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["inner"] == 1
    assert numba.get_num_threads() == before


def _process_threads() -> int:
    """The threads of this process as the kernel counts them (OpenMP's pool threads too)."""
    import os

    return len(os.listdir("/proc/self/task"))


def test_release_thread_pool_frees_the_calling_threads_openmp_pool():
    """After a parallel kernel on two threads the calling thread keeps an OpenMP pool (a thread
    of the process); ``release_thread_pool`` ends it, and the next parallel kernel makes a new
    one and computes as before."""
    import os

    import numba

    from xmc_engine.backends.cpu import numba_threads, release_thread_pool

    if not os.path.isdir("/proc/self/task") or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs Linux's /proc/self/task and numba with at least two threads")

    @numba.njit(parallel=True)
    def total(a):
        s = 0.0
        for i in numba.prange(a.size):
            s += a[i]
        return s

    a = np.ones(100_000)
    with numba_threads(2):
        assert total(a) == a.size
    if numba.threading_layer() != "omp":
        pytest.skip(f"numba's threading layer is {numba.threading_layer()!r}, not 'omp'")
    with_pool = _process_threads()
    assert release_thread_pool() is True
    assert _process_threads() < with_pool
    assert release_thread_pool() is True  # no pool left: nothing to free, no error
    with numba_threads(2):
        assert total(a) == a.size
    assert _process_threads() == with_pool


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"),
                    reason="per-thread page-fault counts need Linux (resource.RUSAGE_THREAD)")
def test_cpu_zeros_are_written_at_allocation():
    """An Adagrad accumulator's pages fault when it is made, not on a training step's first
    write: writing every page of ``CPUBackend.zeros`` costs (almost) no page faults, where the
    lazily mapped pages of ``np.zeros`` fault (at least once per 2 MiB huge page)."""
    import resource

    def faults_writing(a):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        a[::1024] = 1.0  # one write per 4 KiB page
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    n = 16 << 20  # 64 MiB of float32: at least 32 faults on lazy pages
    be = get_backend("cpu")
    a = be.zeros((n,))
    assert a.dtype == np.float32 and a.shape == (n,) and not a.any()
    assert faults_writing(a) < 8
    assert faults_writing(np.zeros(n, np.float32)) >= 32  # the check can tell the two apart
