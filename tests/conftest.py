"""Shared fixtures: the real-data folder, backends by fixture, GPU markers that skip visibly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xmc_engine import _env
from xmc_engine.backends import cuda_available

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    has_gpu = cuda_available()
    skip_gpu = pytest.mark.skip(reason="no usable CUDA device (cupy.is_available() is False)")
    for item in items:
        if ("gpu" in item.keywords or "multi_gpu" in item.keywords) and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    return request.param


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = _env.data_dir()
    if d is None or not d.is_dir():
        pytest.skip("real datasets not found: set XMC_DATA_DIR or provide ../shared/data")
    return d


def real_dataset(data_dir: Path, name: str) -> tuple[Path, Path]:
    train, test = data_dir / name / "train.txt.xz", data_dir / name / "test.txt.xz"
    if not train.exists():
        pytest.skip(f"dataset {name!r} not found under {data_dir}")
    return train, test


@pytest.fixture(autouse=True)
def _no_progress(monkeypatch):
    monkeypatch.setenv("XMC_PROGRESS", os.environ.get("XMC_PROGRESS", "0"))
