"""CUDABackend's own orchestration, over the NumPy stand-in for CuPy (``tests/fake_cupy.py``).

Devices, streams, events, peer access and the memory pool are the stand-in's; the kernels run as
NumPy versions (the numba.cuda kernels themselves are tested under the simulator,
``tests/test_kernels_cuda.py``). Training on the stand-in must end where the CPU backend ends (to
float32 rounding), and the stand-in's ledger must show no cross-stream access that skipped an
event, no device work on the null stream and no host read of an unsynchronised value.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sps

from tests import fake_cupy
from xmc_engine.backends import Backend, get_backend
from xmc_engine.model import MLPReplica, ModelShape, init_params
from xmc_engine.scheduler.merge import (
    central_momentum,
    reduce_gradients,
    sq_norms,
    weighted_merge,
)

F32 = np.float32


@pytest.fixture
def ledger(monkeypatch):
    return fake_cupy.install(monkeypatch, n_devices=2, peer=True)


def cuda(device_id=0):
    from xmc_engine.backends.cuda import CUDABackend

    return CUDABackend(device_id, launch=fake_cupy.launch)


def clean(ledger):
    assert ledger.hazards == []
    assert ledger.null_stream_ops == []


@pytest.fixture(scope="module")
def data():
    X = sps.random(96, 60, density=0.08, format="csr", dtype=F32, random_state=1)
    X.data[:] = 1.0
    Y = sps.random(96, 25, density=0.08, format="csr", dtype=F32, random_state=2)
    Y.data[:] = 1.0
    return X, Y


def host(be, params):
    return [np.array(be.to_host(p)) for p in params]


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


def test_the_stand_in_backend_is_a_whole_backend(ledger):
    be = cuda(1)
    assert isinstance(be, Backend)
    assert be.threads is None and be.tracks_rows is False and be.device_id == 1


def test_prediction_rows_have_the_training_batches_row_pointer_type(ledger):
    """SciPy's int32 row pointers come up as int64, the training batches' type (as on the
    CPU), so that prediction reuses the forward kernel compiled for training."""
    from xmc_engine.batches import RowGather

    X = sps.random(6, 10, density=0.3, format="csr", dtype=F32, random_state=0)
    assert X.indptr.dtype == np.int32
    batch = RowGather(X)(np.arange(3))
    got = [cuda().csr_parts(m) for m in (X, batch)]
    want = get_backend("cpu").csr_parts(X)
    assert [p[0].dtype for p in got] == [np.dtype(np.int64)] * 2
    for a, b in zip(got[0], want, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get() if hasattr(a, "get") else a), b)
        assert a.dtype == b.dtype


@pytest.mark.parametrize("loss", ["softmax", "bce"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("hidden,label_chunk", [((16,), None), ((16, 8), 7)])
def test_training_on_the_stand_in_equals_the_cpu(ledger, data, optimizer, hidden, label_chunk,
                                                 loss):
    X, Y = data
    params = init_params(ModelShape(X.shape[1], Y.shape[1], hidden), seed=3)
    reps = [MLPReplica(be, X, Y, params, label_chunk=label_chunk, optimizer=optimizer,
                       loss=loss)
            for be in (get_backend("cpu", threads=1), cuda(0))]
    rows = np.random.default_rng(0).permutation(X.shape[0])
    losses = {0: [], 1: []}
    for start in range(0, 96, 16):
        for k, r in enumerate(reps):
            losses[k].append(r.train_batch(rows[start:start + 16], 0.5))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    assert all(isinstance(v, float) for v in losses[1])
    assert_same(host(reps[1].backend, reps[1].params()), reps[0].params())
    # the gradient pair of the sync baseline, and predictions
    lg = [r.grad_batch(rows[:16]) for r in reps]
    assert lg[1][0] == pytest.approx(lg[0][0], rel=1e-4)
    for r, (_, g) in zip(reps, lg, strict=True):
        r.apply_grads(g, 0.25)
    assert_same(host(reps[1].backend, reps[1].params()), reps[0].params())
    clean(ledger)


def run_period(reps, steps, lr, threaded):
    """Each replica ``steps`` batches of 8 rows, its worker thread inside ``thread_budget``."""
    def work(i, r):
        with r.backend.thread_budget(None):
            for s in range(steps):
                start = (8 * (i * steps + s)) % 88
                r.train_batch(np.arange(start, start + 8), lr)

    if not threaded:
        for i, r in enumerate(reps):
            work(i, r)
        return
    threads = [threading.Thread(target=work, args=(i, r)) for i, r in enumerate(reps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def merge_and_broadcast(reps, central, prev, spare, p):
    """The adaptive merge's arithmetic (weighted sum, norm, momentum) and its broadcast."""
    be = reps[0].backend
    weighted_merge([r.params() for r in reps], p, spare, be)
    norm = sum(sq_norms(spare, be))
    central_momentum(spare, central, prev, 0.5, spare, be)
    for dst, src in zip(prev, central, strict=True):
        be.copy_into(dst, src)
    for dst, src in zip(central, spare, strict=True):
        be.copy_into(dst, src)
    for r in reps:
        r.set_params(central)
    return norm


@pytest.mark.parametrize("devices", [(0, 0), (0, 1)])
def test_two_workers_with_merges_equal_the_cpu(ledger, data, devices):
    """Two workers (one GPU shared by two streams, or two GPUs with peer access), three merge
    periods: the same model as on CPU backends, and every cross-stream read ordered."""
    X, Y = data
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (12,)), seed=5)
    results = {}
    for kind in ("cpu", "cuda"):
        bes = ([get_backend("cpu", threads=1) for _ in devices] if kind == "cpu"
               else [cuda(d) for d in devices])
        reps = [MLPReplica(be, X, Y, params) for be in bes]
        central = [bes[0].asarray(p.copy()) for p in params]  # the CPU's asarray does not copy
        prev = [bes[0].asarray(p.copy()) for p in params]
        spare = [bes[0].empty(p.shape) for p in params]
        norms = []
        for _ in range(3):
            run_period(reps, 3, 0.3, threaded=kind == "cuda")
            norms.append(merge_and_broadcast(reps, central, prev, spare, [0.7, 0.3]))
        results[kind] = ([host(r.backend, r.params()) for r in reps], norms)
    for got, want in zip(results["cuda"][0], results["cpu"][0], strict=True):
        assert_same(got, want)
    np.testing.assert_allclose(results["cuda"][1], results["cpu"][1], rtol=1e-4)
    clean(ledger)
    waits = [c for c in ledger.calls if c[0] == "wait"]
    assert waits, "the merge and the broadcast wait on recorded events"


@pytest.mark.parametrize("devices", [(0, 0), (0, 1)])
def test_sync_steps_reduce_on_the_device_and_equal_the_cpu(ledger, data, devices):
    """Synchronous SGD: each worker's gradient, the all-reduce on the first device (peer reads,
    no host round trip of the values), the same step on every replica."""
    X, Y = data
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (12,)), seed=7)
    results = {}
    for kind in ("cpu", "cuda"):
        bes = ([get_backend("cpu", threads=1) for _ in devices] if kind == "cpu"
               else [cuda(d) for d in devices])
        reps = [MLPReplica(be, X, Y, params) for be in bes]
        for step in range(4):
            grads = [r.grad_batch(np.arange(12 * (2 * step + i), 12 * (2 * step + i) + 8 + i))
                     for i, r in enumerate(reps)]
            total = reduce_gradients([g for _, g in grads], [8 / 17, 9 / 17], bes[0])
            for r in reps:
                r.apply_grads(total, 0.4)
        results[kind] = [host(r.backend, r.params()) for r in reps]
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        assert_same(got, want)
    assert_same(results["cuda"][1], results["cuda"][0])
    clean(ledger)
    assert not [c for c in ledger.calls if c[0] == "synchronize" and c[1].null]


CROSS_STREAM_READS = {
    "copy_into": lambda be, a, out: be.copy_into(out, a),
    "weighted_sum": lambda be, a, out: be.weighted_sum([a, out], [0.5, 0.5], out),
    "copy_rows": lambda be, a, out: be.copy_rows(out, a, np.array([0, 2])),
    "elastic": lambda be, a, out: be.elastic(out, a, 0.5, be.zeros(out.shape)),
    "merge_rows": lambda be, a, out: be.merge_rows([a], [1.0], np.array([1]), out),
    "copy_columns": lambda be, a, out: be.copy_columns(out, a, np.array([0, 2])),
    "merge_columns": lambda be, a, out: be.merge_columns([a], np.ones((1, 2)), np.array([1, 3]),
                                                         out),
    "merge_rows broadcast": lambda be, a, out: be.merge_rows([a], [1.0], np.array([1]), out,
                                                             broadcast=True),
    "merge_columns broadcast": lambda be, a, out: be.merge_columns(
        [a], np.ones((1, 2)), np.array([1, 3]), out, broadcast=True),
    "all_finite": lambda be, a, out: be.all_finite(a),
}


def test_merges_that_broadcast_write_the_finite_merged_values_back(ledger):
    """``broadcast=True``: the merged rows / columns go back to every replica, except a row
    with a non-finite value (rows) or anything when a value is non-finite (columns)."""
    be = cuda(0)
    a = np.arange(12, dtype=F32).reshape(3, 4)
    b = a + 10
    b[2, 0] = np.nan
    A, B = be.asarray(a), be.asarray(b)
    out = be.zeros((3, 4))
    ok, _ = be.merge_rows([A, B], [0.5, 0.5], np.array([0, 2]), out, broadcast=True)
    assert ok is False
    for x, orig in ((A, a), (B, b)):
        np.testing.assert_array_equal(be.to_host(x)[0], (a[0] + b[0]) / 2)
        np.testing.assert_array_equal(be.to_host(x)[1:], orig[1:])  # row 2 bad, row 1 unlisted
    A, B = be.asarray(a), be.asarray(b)
    assert be.merge_columns([A, B], np.full((2, 2), 0.5), np.array([1, 3]), out,
                            broadcast=True) is True
    for x, orig in ((A, a), (B, b)):
        np.testing.assert_array_equal(be.to_host(x)[:, [1, 3]], (a[:, [1, 3]] + b[:, [1, 3]]) / 2)
        np.testing.assert_array_equal(be.to_host(x)[:, [0, 2]], orig[:, [0, 2]])
    assert be.merge_columns([A, B], np.full((2, 2), 0.5), np.array([0, 1]), out,
                            broadcast=True) is False
    np.testing.assert_array_equal(be.to_host(A)[:, 0], a[:, 0])  # nothing written back
    clean(ledger)


@pytest.mark.parametrize("op", sorted(CROSS_STREAM_READS))
@pytest.mark.parametrize("devices", [(0, 0), (1, 0)])
def test_a_read_of_another_streams_array_is_ordered_both_ways(ledger, op, devices):
    """Backend 0 writes ``a`` and does not synchronise; backend 1 reads it (its stream must wait
    for the write), then backend 0 writes ``a`` again (its stream must wait for the read)."""
    b0, b1 = cuda(devices[0]), cuda(devices[1])
    a = b0.asarray(np.ones((3, 4), F32))
    b0.axpy(a, a, 1.0)  # a = 2, queued on b0's stream
    out = b1.zeros((3, 4))
    CROSS_STREAM_READS[op](b1, a, out)
    b0.axpy(a, a, 1.0)  # a = 4: must not overtake b1's read
    clean(ledger)
    assert b0.to_host(a)[0, 0] == 4.0


def test_worker_context_is_the_backends_device_and_stream(ledger):
    be = cuda(1)
    seen = {}

    def worker():
        with be.thread_budget(4):
            seen["device"] = fake_cupy.current_device()
            seen["stream"] = fake_cupy.current_stream()
            with be.activate():  # re-entrant
                seen["inner"] = fake_cupy.current_stream()
        seen["after"] = fake_cupy.current_stream()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["device"] == 1 and seen["stream"] is be.stream and seen["inner"] is be.stream
    assert seen["after"].null


@pytest.mark.parametrize("peer", [True, False])
def test_copies_between_devices_check_peer_access(monkeypatch, peer):
    ledger = fake_cupy.install(monkeypatch, n_devices=2, peer=peer)
    b0, b1 = cuda(0), cuda(1)
    src = b1.asarray(np.arange(12, dtype=F32).reshape(3, 4))
    for _ in range(2):
        dst = b0.zeros((3, 4))
        b0.copy_into(dst, src)
        np.testing.assert_array_equal(b0.to_host(dst), np.arange(12).reshape(3, 4))
    asked = [c for c in ledger.calls if c[0] == "deviceCanAccessPeer"]
    enabled = [c for c in ledger.calls if c[0] == "deviceEnablePeerAccess"]
    assert asked == [("deviceCanAccessPeer", 0, 1)]  # asked once, the answer kept
    assert enabled == ([("deviceEnablePeerAccess", 0, 1)] if peer else [])
    clean(ledger)


# -- the ledger finds what it is for ------------------------------------------------------------
def test_ledger_finds_an_unordered_cross_stream_read(ledger):
    b0, b1 = cuda(0), cuda(0)
    a = b0.zeros(5)
    with b1.activate():
        a.sum()  # b1's stream reads what b0's stream wrote, no event between
    assert any("without waiting" in h for h in ledger.hazards)


def test_ledger_finds_null_stream_work_and_unsynchronised_host_reads(ledger):
    be = cuda(0)
    fake_cupy.zeros(3)  # outside any stream context
    assert ledger.null_stream_ops == ["allocate"]
    x = be.zeros(())
    float(x)  # not synchronised
    assert any("before synchronising" in h for h in ledger.hazards)
    assert be.to_float(x) == 0.0  # to_float synchronises first


# -- whole fits through the estimator ---------------------------------------------------------
@pytest.fixture
def stand_in_cuda(ledger, monkeypatch):
    """``get_backend("cuda", ...)`` builds CUDA backends over the stand-in."""
    import xmc_engine.backends.cuda as cuda_module

    class StandInCUDABackend(cuda_module.CUDABackend):
        def __init__(self, device_id=0, *, launch=fake_cupy.launch):
            super().__init__(device_id, launch=launch)

    monkeypatch.setattr(cuda_module, "CUDABackend", StandInCUDABackend)
    return ledger


FIT = dict(hidden=16, epochs=2, batch_size=64, lr=0.5, seed=0, eval_every=0)


@pytest.mark.parametrize("loss", ["softmax", "bce"])
def test_fit_on_cuda0_equals_the_cpu_fit(stand_in_cuda, loss):
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data()
    gpu = XMCClassifier(devices="cuda:0", loss=loss, **FIT).fit(X, Y)
    cpu = XMCClassifier(devices="cpu", loss=loss, **FIT).fit(X, Y)
    assert_same([np.asarray(p) for p in gpu.params_], [np.asarray(p) for p in cpu.params_])
    clean(stand_in_cuda)


@pytest.mark.parametrize("loss", ["auto", "bce"])
def test_fit_with_two_workers_on_one_gpu_orders_every_access(stand_in_cuda, loss):
    """``adaptive`` on two workers of one GPU; with the logistic loss its first half epoch
    goes to the first device alone (``solo_epochs``: the merge copies its replica whole, the
    backend tracking no rows, then hands the model and accumulators to the other)."""
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data()
    est = XMCClassifier(devices="cuda:0,cuda:0@0.5", algorithm="adaptive", loss=loss,
                        **FIT).fit(X, Y)
    assert all(np.isfinite(np.asarray(p)).all() for p in est.params_)
    alone = [r for r in est.history_ if r.get("event") == "merge" and "solo" in r]
    assert bool(alone) is (loss == "bce")
    clean(stand_in_cuda)


def test_upload_packs_a_batch_into_alternating_pinned_buffers(ledger):
    be = cuda(0)
    rng = np.random.default_rng(0)
    batches = [[rng.integers(0, 9, n).astype(np.int64), rng.standard_normal(n).astype(F32),
                np.arange(n % 3, dtype=np.int32)] for n in (5, 0, 7)]
    records = []
    for arrays in batches:
        out = be.upload(arrays)
        records.append([c for c in ledger.calls if c[0] == "record"][-1])
        for got, want in zip(out, arrays, strict=True):
            assert got.dtype == want.dtype and got.device_id == 0
            np.testing.assert_array_equal(be.to_host(got), want)
    waited = [c for c in ledger.calls if c[0] == "event.synchronize"]
    # the third upload reuses the first one's buffer: it waits for that copy's event first
    assert ("event.synchronize", be.stream, records[0][2]) in waited
    clean(ledger)


def test_gpu_check_softmax_comparison_runs_on_the_stand_in(ledger):
    """``bench/gpu_check.py``'s timing of the tiled softmax against the previous kernel: its
    plumbing (workspaces, launches, events) over the stand-in, where both are the reference."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_check

    out = gpu_check.time_softmax(cuda(), B=6, L=40, repeat=2)
    assert out["tiled"] > 0 and out["rowblock + column sum"] > 0
    assert out["max_abs_diff_dZ"] <= 1e-7 and out["max_abs_diff_db2"] <= 1e-6
    clean(ledger)


def test_keep_best_puts_the_best_epochs_model_back_on_the_device(stand_in_cuda, monkeypatch):
    """``keep_best`` and ``back_to_best`` on a CUDA device: the best epoch's host copy is
    written back into the device's model (scripted held-out P@1: 0.5 after epoch 1, then 0.2,
    where training goes on from epoch 1's model, and 0.1 for the last model, which the run
    ends without), and every access is ordered."""
    from tests._helpers import script_heldout
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data()
    _, models = script_heldout(monkeypatch, [0.5, 0.2, 0.1])
    est = XMCClassifier(devices="cuda:0", lr_decay="plateau", loss="softmax",
                        **{**FIT, "epochs": 3}).fit(X, Y)
    assert [r["back_to"] for r in est.history_ if r["event"] == "plateau"] == [None, 1]
    kept, = [r for r in est.history_ if r["event"] == "keep_best"]
    assert kept["restored"] and kept["best_epoch"] == 1
    for got, want in zip(est.params_, models[0], strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    clean(stand_in_cuda)


def test_an_ensemble_on_the_device_equals_the_cpu_one(stand_in_cuda):
    """``ensemble=2`` on a CUDA device: the members train there, their combination is
    evaluated there, and both equal the CPU run's; every access is ordered."""
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data()
    kw = dict(ensemble=2, loss="softmax", **FIT)
    gpu = XMCClassifier(devices="cuda:0", **kw).fit(X[:500], Y[:500], (X[500:], Y[500:]))
    cpu = XMCClassifier(devices="cpu", threads=1, **kw).fit(X[:500], Y[:500],
                                                           (X[500:], Y[500:]))
    assert [p.shape for p in gpu.params_][0] == (X.shape[1], 32)
    assert_same([np.asarray(p) for p in gpu.params_], [np.asarray(p) for p in cpu.params_])
    assert gpu.metrics_["P@1"] == pytest.approx(cpu.metrics_["P@1"])
    clean(stand_in_cuda)
