"""Numba's cache of the kernels is invalidated by an edit of any kernel module (kernels/_cache.py):
a kernel that calls another module's kernel holds its compiled code, and numba alone would
only look at the caller's own file."""

from __future__ import annotations

from xmc_engine.kernels import _cache, adagrad, train_step

from xmc_engine.batches import take_rows


def test_package_stamp_follows_every_module(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = _cache.package_stamp(tmp_path)
    assert _cache.package_stamp(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 3\n")  # an edit of another module than a function's own
    assert _cache.package_stamp(tmp_path) != first
    (tmp_path / "c.py").write_text("")  # a new module
    assert _cache.package_stamp(tmp_path) != first


def test_kernels_use_the_package_locator():
    assert _cache.install()  # idempotent: already installed by the package
    for fn in (train_step.train_step_cpu, adagrad.adagrad_dense_cpu):
        locator = fn._cache._impl.locator
        assert getattr(type(locator), "_xmc_kernels", False)
        own, package = locator.get_source_stamp()
        assert package == _cache.package_stamp()
    # functions outside the package keep numba's own rule
    assert not getattr(type(take_rows._cache._impl.locator), "_xmc_kernels", False)
