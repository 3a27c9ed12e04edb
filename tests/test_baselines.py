"""The baselines of DESIGN.md §4 (sync, easgd, crossbow): configs, the replica gradient API, each
update rule against a hand computation on a tiny model, and end-to-end runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._trainer import make_trainer
from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier
from xmc_engine.algorithms import EASGD, Crossbow, SyncSGD, get_algorithm
from xmc_engine.backends import get_backend
from xmc_engine.config import CrossbowConfig, EASGDConfig, SyncConfig
from xmc_engine.devices import parse_devices
from xmc_engine.errors import ConfigError
from xmc_engine.model import MLPReplica, ModelShape, init_params
from xmc_engine.scheduler import FakeReplica, MergeContext
from xmc_engine.scheduler.merge import reduce_gradients


@pytest.fixture(scope="module")
def toy():
    X, Y = tiny_data()
    return X[:500], Y[:500], X[500:], Y[500:]


def mlp(X, Y, hidden=(16,), seed=0, label_chunk=None, cls=MLPReplica):
    p = init_params(ModelShape(X.shape[1], Y.shape[1], tuple(hidden)), seed, avg_nnz=8.0)
    return cls(get_backend("cpu", threads=1), X, Y, p, label_chunk=label_chunk)


def close(a, b, tol=1e-5):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# -- configs and registry ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [SyncConfig, EASGDConfig, CrossbowConfig])
def test_config_json_round_trip_and_unknown_keys(cls):
    c = cls()
    assert cls.from_json(c.to_json()) == c
    d = json.loads(c.to_json())
    d["rejoin_after"] = 2
    assert cls.from_dict(d).rejoin_after == 2
    with pytest.raises(ConfigError, match="unknown key"):
        cls.from_dict({"batch_size": 3})  # the run's, not the algorithm's
    with pytest.raises(ConfigError, match="rejoin_after"):
        cls.from_dict({"rejoin_after": "soon"})


def test_config_validation_and_registry():
    with pytest.raises(ConfigError, match="beta"):
        EASGDConfig(beta=1.5)
    with pytest.raises(ConfigError, match="momentum"):
        CrossbowConfig(momentum=1.0)
    with pytest.raises(ConfigError, match="tau"):
        EASGDConfig(tau=0)
    assert isinstance(get_algorithm("sync", lr_scaling=True), SyncSGD)
    assert isinstance(get_algorithm("easgd", {"tau": 2}), EASGD)
    assert isinstance(get_algorithm("crossbow"), Crossbow)
    assert get_algorithm("crossbow", CrossbowConfig(momentum=0.5), tau=2).config.tau == 2
    with pytest.raises(ConfigError, match="unknown key"):
        get_algorithm("easgd", momentum=0.9)


# -- replica gradient API ------------------------------------------------------------------------
@pytest.mark.parametrize("hidden,label_chunk", [((16,), None), ((16, 8), 7)])
def test_apply_grads_of_grad_batch_equals_train_batch(toy, hidden, label_chunk):
    X, Y, _, _ = toy
    a, b = mlp(X, Y, hidden, label_chunk=label_chunk), mlp(X, Y, hidden, label_chunk=label_chunk)
    p0 = [np.array(p) for p in a.params()]
    rows = np.arange(7, 47, dtype=np.int64)
    loss_a = a.train_batch(rows, 0.7)
    loss_b, g = b.grad_batch(rows)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    r, gr = g[0]
    assert r.dtype == np.int64 and np.all(np.diff(r) > 0) and gr.shape == (len(r), hidden[0])
    assert set(r) == set(X[rows].indices)
    assert [x.shape for x in g[1:]] == [p.shape for p in p0[1:]]
    close(b.params(), p0, 0)  # grad_batch does not update
    b.apply_grads(g, 0.7)
    close(b.params(), a.params(), 1e-6)
    assert not np.allclose(a.params()[-2], p0[-2])


def test_fake_replica_grads_match_train_batch():
    a, b = FakeReplica(10, sleep=False), FakeReplica(10, sleep=False)
    rows = np.array([1, 4, 5])
    la = a.train_batch(rows, 0.3)
    lb, g = b.grad_batch(rows)
    b.apply_grads(g, 0.3)
    assert la == pytest.approx(lb)
    close(a.params(), b.params(), 1e-12)


def test_allreduce_sparse_union_and_weights():
    rng = np.random.default_rng(0)
    h = 3
    dense = []
    grads = []
    for rows in ([0, 3, 7], [3, 5], [1, 7, 9]):
        rows = np.array(rows, np.int64)
        g1 = rng.standard_normal((len(rows), h)).astype(np.float32)
        full = np.zeros((10, h), np.float32)
        full[rows] = g1
        b = rng.standard_normal(4).astype(np.float32)
        dense.append((full, b))
        grads.append([(rows, g1), b])
    w = [0.5, 0.25, 0.25]
    out = reduce_gradients(grads + [None], w + [0.0], get_backend("cpu", threads=1))
    rows, g1 = out[0]
    np.testing.assert_array_equal(rows, [0, 1, 3, 5, 7, 9])
    ref = sum(wi * f for wi, (f, _) in zip(w, dense, strict=True))
    np.testing.assert_allclose(g1, ref[rows], rtol=1e-6)
    np.testing.assert_allclose(out[1], sum(wi * b for wi, (_, b) in zip(w, dense, strict=True)),
                               rtol=1e-6)
    assert grads[0][1] is not out[1]


# -- sync ----------------------------------------------------------------------------------------
class RecordingMLP(MLPReplica):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = []

    def grad_batch(self, rows):
        self.steps.append(np.array(rows))
        return super().grad_batch(rows)


def _trainer(reps, spec, pol, n_samples, mode="simulated", **schedule):
    return make_trainer(reps, parse_devices(spec, cores=2), pol, n_samples, seed=3, mode=mode,
                        **schedule)


def test_sync_fake_replicas_hand_computation():
    """Two devices, global batch 2b: w <- w - lr (w - mean of the global batch's targets)."""
    n = 40
    reps = [FakeReplica(n, sleep=False, seed=0, shapes=((3, 2), (2,))) for _ in range(2)]
    w = [np.array(p) for p in reps[0].params()]
    targets = reps[0]._targets
    pol = get_algorithm("sync")
    with _trainer(reps, "cpu,cpu@0.5", pol, n, lr=0.2, batch_size=4, warmup_epochs=0,
                  lr_decay=0) as tr:
        res = tr.run_epoch(0)
    h0, h1 = reps[0].history, reps[1].history
    assert len(h0) == len(h1) == 5 and res["updates"] == 2 * 5 and res["samples"] == n
    for (r0, _), (r1, _) in zip(h0, h1, strict=True):
        glob = np.concatenate([r0, r1])
        w = [x - 0.2 * (x - t[glob].mean(axis=0)) for x, t in zip(w, targets, strict=True)]
    close(reps[0].params(), w, 1e-12)
    close(reps[1].params(), w, 1e-12)
    close(tr.central_params(), w, 1e-12)
    # the slower device sets the pace: device 0 idles as long as it is busy
    d0, d1 = res["devices"]
    assert d0["idle_s"] == pytest.approx(d0["busy_s"], rel=1e-6) and d1["idle_s"] == 0


@pytest.mark.parametrize("mode", ["simulated", "threads"])
def test_sync_n_devices_equals_one_device_on_global_batch(toy, mode):
    X, Y, _, _ = toy
    X, Y = X[:150], Y[:150]
    reps = [mlp(X, Y, cls=RecordingMLP) for _ in range(3)]
    ref = mlp(X, Y)
    pol = get_algorithm("sync")
    with _trainer(reps, "cpu,cpu@0.5,cpu", pol, X.shape[0], mode=mode, lr=0.5, batch_size=8,
                  warmup_epochs=0, lr_decay=0) as tr:
        tr.run_epoch(0)
        tr.run_epoch(1)
    steps = list(zip(*(r.steps for r in reps), strict=True))
    assert len(steps) == 2 * 7  # 150 rows per epoch in global batches of 24 (last one 6)
    for step in steps:
        rows = np.concatenate(step)  # the short last batch at the rate of its 6 rows
        ref.train_batch(rows, 0.5 * min(len(rows), 24) / 24)
    for r in reps:
        close(r.params(), ref.params(), 2e-5)
    close(tr.central_params(), ref.params(), 2e-5)


def test_sync_split_global_batch_and_lr_scaling():
    reps = [FakeReplica(30, sleep=False) for _ in range(2)]
    pol = get_algorithm("sync", split_global_batch=True)
    with _trainer(reps, "cpu,cpu", pol, 30, batch_size=6) as tr:
        tr.run_epoch(0)
        assert pol.batch_sizes() == [3, 3] and tr.queue.merge_period == 6
    assert [len(r) for r, _ in reps[0].history] == [3] * 5
    with pytest.raises(ConfigError, match="divisible"):
        _trainer([FakeReplica(30, sleep=False) for _ in range(2)], "cpu,cpu",
                 get_algorithm("sync", split_global_batch=True), 30, batch_size=5)
    pol2 = get_algorithm("sync", lr_scaling=True)
    pol2.setup([FakeReplica(4, sleep=False) for _ in range(3)], n_samples=4, batch_size=5,
               merge_period=15, warmup_epochs=0.0)
    assert pol2.device_lrs(0.1) == [pytest.approx(0.3)] * 3


# -- easgd / crossbow: hand computations on FakeReplicas ------------------------------------------
def _elastic_run(algorithm, n_dev=2, n_samples=48, epochs=2, lr=0.3, **cfg):
    reps = [FakeReplica(n_samples, sleep=False, seed=0, shapes=((3, 2), (2,)))
            for _ in range(n_dev)]
    x0 = [np.array(p) for p in reps[0].params()]
    pol = get_algorithm(algorithm, **cfg)
    spec = ",".join(["cpu", "cpu@0.5", "cpu@0.25"][:n_dev])
    with _trainer(reps, spec, pol, n_samples, lr=lr, batch_size=4, warmup_epochs=0,
                  lr_decay=0) as tr:
        for e in range(epochs):
            tr.run_epoch(e)
    return reps, x0, pol, tr


def _sgd(w, targets, rows, lr):
    return [x - lr * (x - t[rows].mean(axis=0)) for x, t in zip(w, targets, strict=True)]


def test_easgd_hand_computation():
    tau, n_dev = 2, 2
    reps, x0, pol, tr = _elastic_run("easgd", n_dev, tau=tau)
    a = 0.9 / n_dev
    assert pol.alpha == pytest.approx(a) and pol.merge_period == n_dev * tau * 4
    targets = reps[0]._targets
    x = [[p.copy() for p in x0] for _ in range(n_dev)]
    center = [p.copy() for p in x0]
    n_periods = len(reps[0].history) // tau
    assert n_periods == 6 and all(len(r.history) == n_periods * tau for r in reps)
    for k in range(n_periods):
        for i, r in enumerate(reps):
            for rows, lr in r.history[k * tau:(k + 1) * tau]:
                x[i] = _sgd(x[i], targets, rows, lr)
        new_center = [c + a * sum(xi[j] - c for xi in x) for j, c in enumerate(center)]
        x = [[xi[j] - a * (xi[j] - c) for j, c in enumerate(center)] for xi in x]
        center = new_center
    for i, r in enumerate(reps):
        close(r.params(), x[i], 1e-12)
    close(tr.central_params(), center, 1e-12)
    assert not np.allclose(reps[0].params()[0], reps[1].params()[0])  # no broadcast


@pytest.mark.parametrize("alpha,momentum", [(0.0, 0.9), (0.2, 0.9), (0.2, 0.0)])
def test_crossbow_hand_computation(alpha, momentum):
    n_dev = 3
    reps, x0, pol, tr = _elastic_run("crossbow", n_dev, n_samples=36, alpha=alpha,
                                     momentum=momentum)
    a = alpha or 1.0 / n_dev
    assert pol.alpha == pytest.approx(a) and pol.merge_period == n_dev * 4
    targets = reps[0]._targets
    w = [[p.copy() for p in x0] for _ in range(n_dev)]
    z, z_prev = [p.copy() for p in x0], [p.copy() for p in x0]
    n_steps = len(reps[0].history)
    assert n_steps == 6
    for k in range(n_steps):
        for i, r in enumerate(reps):
            rows, lr = r.history[k]
            w[i] = _sgd(w[i], targets, rows, lr)
        c = [[a * (wi[j] - zj) for j, zj in enumerate(z)] for wi in w]
        w = [[wi[j] - ci[j] for j in range(len(z))] for wi, ci in zip(w, c, strict=True)]
        z_new = [zj + sum(ci[j] for ci in c) + momentum * (zj - z_prev[j])
                 for j, zj in enumerate(z)]
        z_prev, z = z, z_new
    for i, r in enumerate(reps):
        close(r.params(), w[i], 1e-12)
    close(tr.central_params(), z, 1e-12)


@pytest.mark.parametrize("name", ["easgd", "crossbow"])
def test_elastic_nonfinite_replica_left_out_and_reset(name):
    reps = [FakeReplica(8, sleep=False, seed=s) for s in (0, 1)]
    pol = get_algorithm(name, momentum=0.0) if name == "crossbow" else get_algorithm(name)
    pol.setup(reps, n_samples=8, batch_size=2, merge_period=4, warmup_epochs=0.0)
    center = [np.array(p) for p in pol.central_params()]
    x0 = [np.array(p) for p in reps[0].params()]
    for p in reps[1].params():
        p[...] = np.nan
    info = pol.merge(reps, [1, 1], MergeContext())
    a = pol.alpha
    assert info["nonfinite"] == [1] and info["weights"] == [a, 0.0]
    expect = [c + a * (x - c) for c, x in zip(center, x0, strict=True)]
    close(pol.central_params(), expect, 1e-12)
    close(reps[1].params(), expect, 1e-12)
    close(reps[0].params(), [x - a * (x - c) for c, x in zip(center, x0, strict=True)], 1e-12)


# -- end to end ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["sync", "easgd", "crossbow"])
def test_classifier_end_to_end_beats_popular(toy, algorithm):
    Xtr, Ytr, Xte, Yte = toy
    m = XMCClassifier(hidden=32, epochs=6, batch_size=32, lr=0.5, seed=0,
                      devices="cpu,cpu@0.5", algorithm=algorithm, eval_every=0)
    m.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    popular = int(np.asarray(Ytr.sum(0)).argmax())
    p1_popular = float(Yte[:, popular].mean())
    assert m.metrics_["P@1"] > p1_popular + 0.2, (m.metrics_["P@1"], p1_popular)
    merges = [r for r in m.history_ if r["event"] == "merge"]
    assert merges and all(r["algorithm"] == algorithm for r in merges)
