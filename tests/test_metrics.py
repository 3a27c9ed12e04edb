"""Top-k metrics against brute-force definitions written as plain Python loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_engine.metrics import TopKMetrics, evaluate, jain_propensity


def brute_force(top, label_sets, ks, inv_p=None):
    """The XC-repository / pyxclib definitions, one row at a time."""
    n = len(label_sets)
    out = {}
    disc = [1.0 / math.log2(j + 2) for j in range(max(ks))]
    for k in ks:
        p = r = nd = 0.0
        psp_num = psp_den = psn_num = psn_den = 0.0
        for i in range(n):
            y = label_sets[i]
            row = [int(t) for t in top[i][:k]]
            hits = [1.0 if (t >= 0 and t in y) else 0.0 for t in row]
            p += sum(hits) / k
            r += sum(hits) / len(y) if y else 0.0
            idcg = sum(disc[: min(k, len(y))])
            dcg = sum(h * disc[j] for j, h in enumerate(hits))
            nd += dcg / idcg if y else 0.0
            if inv_p is not None:
                w = [inv_p[t] if h else 0.0 for t, h in zip(row, hits, strict=True)]
                best = sorted((inv_p[l] for l in y), reverse=True)[:k]
                psp_num += sum(w) / k
                psp_den += sum(best) / k
                if y:
                    psn_num += sum(wj * disc[j] for j, wj in enumerate(w)) / idcg
                    psn_den += sum(bj * disc[j] for j, bj in enumerate(best)) / idcg
        out[f"P@{k}"] = p / n
        out[f"nDCG@{k}"] = nd / n
        out[f"R@{k}"] = r / n
        if inv_p is not None:
            out[f"PSP@{k}"] = psp_num / psp_den if psp_den else 0.0
            out[f"PSnDCG@{k}"] = psn_num / psn_den if psn_den else 0.0
    return out


def random_problem(rng, n=200, n_labels=40, kmax=5, empty_frac=0.2):
    label_sets = []
    for _ in range(n):
        m = 0 if rng.random() < empty_frac else int(rng.integers(1, 8))
        label_sets.append(set(rng.choice(n_labels, size=m, replace=False).tolist()))
    rows = [i for i, y in enumerate(label_sets) for _ in y]
    cols = [l for y in label_sets for l in sorted(y)]
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n, n_labels))
    # predictions that hit often: true labels shuffled in among random ones
    top = np.empty((n, kmax), dtype=np.int64)
    for i, y in enumerate(label_sets):
        cand = list(y) + rng.permutation(n_labels).tolist()
        seen, row = set(), []
        for c in rng.permutation(len(cand[:12])).tolist() + list(range(12, len(cand))):
            if cand[c] not in seen:
                seen.add(cand[c])
                row.append(cand[c])
            if len(row) == kmax:
                break
        top[i] = row
    return top, Y, label_sets


def assert_close(got, want):
    assert list(got) == list(want) or set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_with_propensity(seed):
    rng = np.random.default_rng(seed)
    top, Y, label_sets = random_problem(rng)
    p = jain_propensity(rng.integers(0, 50, size=Y.shape[1]), n_samples=1000)
    got = evaluate(top, Y, ks=(1, 3, 5), propensity=p)
    assert_close(got, brute_force(top, label_sets, (1, 3, 5), inv_p=1.0 / p))
    assert list(got) == ["P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "R@1", "R@3",
                         "R@5", "PSP@1", "PSP@3", "PSP@5", "PSnDCG@1", "PSnDCG@3", "PSnDCG@5"]


def test_keys_without_propensity():
    rng = np.random.default_rng(3)
    top, Y, label_sets = random_problem(rng)
    got = evaluate(top, Y, ks=(1, 2))
    assert list(got) == ["P@1", "P@2", "nDCG@1", "nDCG@2", "R@1", "R@2"]
    assert_close(got, brute_force(top, label_sets, (1, 2)))


def test_streaming_equals_one_shot():
    rng = np.random.default_rng(4)
    top, Y, _ = random_problem(rng, n=301)
    p = jain_propensity(Y)
    whole = evaluate(top, Y, propensity=p)
    acc = TopKMetrics(propensity=p)
    for lo, hi in [(0, 1), (1, 100), (100, 100), (100, 257), (257, 301)]:
        acc.update(top[lo:hi], Y[lo:hi])
    assert acc.n_samples == 301
    assert_close(acc.result(), whole)
    acc.reset()
    assert acc.n_samples == 0 and acc.result()["P@1"] == 0.0


def test_rows_without_labels_count_as_zero():
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=np.float32))
    top = np.array([[0, 1, 2], [0, 1, 2]])
    got = evaluate(top, Y, ks=(1, 3), propensity=np.full(4, 0.5))
    assert got["P@1"] == 0.5 and got["nDCG@1"] == 0.5 and got["R@3"] == 0.5
    assert got["P@3"] == pytest.approx(1 / 6)
    assert got["PSP@1"] == 1.0 and got["PSnDCG@3"] == 1.0
    # no row has a label at all: zeros, not NaN
    empty = evaluate(top, sp.csr_matrix((2, 4)), ks=(1,), propensity=np.full(4, 0.5))
    assert empty == {"P@1": 0.0, "nDCG@1": 0.0, "R@1": 0.0, "PSP@1": 0.0, "PSnDCG@1": 0.0}


def test_k_larger_than_n_labels_and_padding():
    Y = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1]], dtype=np.float32))
    top = np.array([[1, 0, 2], [2, -1, -1]])  # every label predicted; -1 pads
    got = evaluate(top, Y, ks=(1, 5))
    want = brute_force(top, [{0, 1}, {2}], (1, 5))
    assert_close(got, want)
    assert got["P@5"] == pytest.approx((2 / 5 + 1 / 5) / 2)
    assert got["nDCG@5"] == pytest.approx(1.0) and got["R@5"] == 1.0


def test_non_canonical_Y_and_other_inputs():
    # duplicate entries, unsorted indices and an explicit zero in Y; a list for top_labels
    Y = sp.csr_matrix((np.array([1, 1, 0, 1.0]), np.array([3, 1, 2, 3]), np.array([0, 4])),
                      shape=(1, 5))
    assert not Y.has_canonical_format
    got = evaluate([[2, 3, 1]], Y, ks=(1, 3))
    assert_close(got, brute_force([[2, 3, 1]], [{1, 3}], (1, 3)))
    assert Y.nnz == 4  # the caller's matrix is not modified
    got_csc = evaluate(np.array([[2, 3, 1]]), Y.tocsc(), ks=(1, 3))
    assert_close(got_csc, got)


def test_large_label_space_sparse_only():
    n_labels, n = 3_000_000, 1000
    rng = np.random.default_rng(5)
    cols = rng.integers(0, n_labels, size=(n, 3))
    Y = sp.csr_matrix((np.ones(3 * n), cols.ravel(), np.arange(0, 3 * n + 1, 3)),
                      shape=(n, n_labels))
    top = np.concatenate([cols[:, :1], rng.integers(0, n_labels, size=(n, 4))], axis=1)
    got = evaluate(top, Y, propensity=jain_propensity(Y))
    assert got["P@1"] == 1.0


@pytest.mark.parametrize("top, msg", [
    (np.zeros((2, 1), dtype=np.int64), "fewer than max"),
    (np.array([[0, 1, 9], [0, 1, 2]]), "n_labels"),
    (np.array([[0, 0, 1], [0, 1, 2]]), "repeats"),
    (np.zeros((2, 3)), "integer"),
    (np.zeros((3, 3), dtype=np.int64), "rows"),
])
def test_bad_inputs(top, msg):
    Y = sp.csr_matrix(np.eye(2, 5))
    with pytest.raises(ValueError, match=msg):
        evaluate(top, Y, ks=(1, 3))


def test_propensity_validation():
    Y = sp.csr_matrix(np.eye(2, 5))
    with pytest.raises(ValueError, match="propensity has 4"):
        evaluate(np.zeros((2, 3), dtype=int) + [0, 1, 2], Y, ks=(1,), propensity=np.ones(4))
    with pytest.raises(ValueError, match="> 0"):
        TopKMetrics(propensity=np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="ks"):
        TopKMetrics(ks=(0, 1))


def test_jain_propensity_formula():
    counts = np.array([0, 1, 10, 1000])
    N, A, B = 5000, 0.6, 2.6
    C = (math.log(N) - 1) * (B + 1) ** A
    want = [1 / (1 + C * math.exp(-A * math.log(c + B))) for c in counts]
    got = jain_propensity(counts, n_samples=N, A=A, B=B)
    assert got.dtype == np.float64 and got.shape == (4,)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    assert np.all(np.diff(got) > 0)  # frequent labels are more likely to be observed
    Y = sp.csr_matrix(np.array([[1, 0, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=np.float32))
    np.testing.assert_allclose(jain_propensity(Y), jain_propensity([3, 1, 1], n_samples=4))
    with pytest.raises(ValueError, match="n_samples"):
        jain_propensity([1, 2])
    with pytest.raises(ValueError, match="at least 3"):
        jain_propensity([1, 2], n_samples=2)
