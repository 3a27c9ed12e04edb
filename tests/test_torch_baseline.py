"""The PyTorch framework baseline (bench/torch_baseline.py): its SGD step is the engine's step,
and its Adam variants train. PyTorch is an optional extra (``pip install torch==2.13.0``, the
CPU build); without it these tests are skipped with that reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install torch==2.13.0 "
                            "(the CPU build) to test the framework baseline")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import torch_baseline  # noqa: E402
from xmc_engine.datasets import make_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def data():
    return make_synthetic("default", n_train=600, n_test=200, n_features=300, n_labels=40,
                          seed=0)


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 0.5), ("adagrad", 0.05)])
def test_step_equals_the_engines_step(data, optimizer, lr):
    """Three steps of the baseline's SGD / Adagrad from the engine's init give the engine's
    parameters; a step that differs (another learning rate on one side) would move them by
    about lr per touched entry, far above the bound."""
    X, Y, _, _ = data
    check = torch_baseline.check_against_engine(X, Y, hidden=16, batch_size=64, lr=lr,
                                                n_steps=3, optimizer=optimizer)
    assert check is not None
    assert check["optimizer"] == optimizer
    assert max(check["max_abs_diff"].values()) < 1e-4
    assert check["loss_torch"] == pytest.approx(check["loss_engine"], rel=1e-4)


@pytest.mark.parametrize(("optimizer", "lr"), [("adam", 1e-2), ("sparse_adam", 1e-2),
                                               ("adagrad", 0.05)])
def test_adam_and_adagrad_variants_learn(data, optimizer, lr):
    X, Y, Xt, Yt = data
    res = torch_baseline.train_torch(X, Y, Xt, Yt, hidden=16, batch_size=64, lr=lr,
                                     epochs=4, threads=1, eval_every=1.0, optimizer=optimizer)
    assert res["config"]["optimizer"] == optimizer
    assert res["config"]["sparse_grad"] is (optimizer != "adam")
    losses = [r["loss"] for r in res["curve"]]
    assert losses[-1] < 0.9 * losses[0]
    popularity = np.asarray(Y.sum(axis=0)).ravel().argmax()
    p1_popular = float(np.asarray(Yt[:, popularity].todense()).mean())
    assert res["curve"][-1]["P@1"] > p1_popular


def test_sparse_adam_moves_only_the_batch_rows_of_w1(data):
    X, Y, _, _ = data
    model = torch_baseline.SparseMLP(X.shape[1], Y.shape[1], 8, sparse=True)
    before = model.emb.weight.detach().clone()
    opts = torch_baseline.make_optimizer(model, "sparse_adam", 1e-2)
    b = next(torch_baseline.make_batches(X, Y, 32, 0, 0))
    torch_baseline.batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                              1.0 / b.n_rows).backward()
    for opt in opts:
        opt.step()
    moved = (model.emb.weight.detach() != before).any(dim=1).numpy()
    touched = np.zeros(X.shape[1], dtype=bool)
    touched[b.input.numpy()] = True
    assert moved.any()
    assert not (moved & ~touched).any()


def test_unknown_optimizer_is_refused():
    model = torch_baseline.SparseMLP(10, 3, 4)
    with pytest.raises(ValueError, match="choose one of sgd, adam, sparse_adam, adagrad"):
        torch_baseline.make_optimizer(model, "lbfgs", 0.1)


def test_the_logistic_loss_equals_the_engines(data):
    """``batch_loss(..., loss="bce")`` and the engine's ``loss="bce"`` give the same loss and
    output-layer gradient on one batch from the same start (a row without labels included)."""
    from xmc_engine.backends import get_backend
    from xmc_engine.model import MLPReplica
    from xmc_engine.scheduler.queue import epoch_permutation

    X, Y, _, _ = data
    Y = Y.tolil()
    rows = epoch_permutation(X.shape[0], 0, 0)[:32]
    Y[int(rows[3]), :] = 0  # a row without labels: no loss, no gradient, in both
    Y = Y.tocsr()
    init = torch_baseline.engine_init(X.shape[1], Y.shape[1], 8, X, 0, "bce")
    np.testing.assert_allclose(init[-1], -np.log(Y.shape[1]), rtol=1e-6)
    model = torch_baseline.SparseMLP(X.shape[1], Y.shape[1], 8, init=init)
    b = next(torch_baseline.make_batches(X, Y, 32, 0, 0))
    loss = torch_baseline.batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                                     1.0 / b.n_rows, "bce")
    loss.backward()
    engine = MLPReplica(get_backend("cpu", threads=1), X, Y, init, loss="bce")
    loss_e, grads = engine.grad_batch(rows)
    assert float(loss.detach()) * b.n_rows == pytest.approx(loss_e, rel=1e-4)
    np.testing.assert_allclose(model.out.weight.grad.numpy().T, grads[-2], atol=1e-6)
    np.testing.assert_allclose(model.out.bias.grad.numpy(), grads[-1], atol=1e-6)
    with pytest.raises(ValueError, match="loss='hinge'"):
        torch_baseline.batch_loss(model(b.input, b.offsets, b.per_sample_weights), b.target,
                                  1.0, "hinge")
