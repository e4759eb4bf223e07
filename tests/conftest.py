"""Shared fixtures: small real data, small configs, no downloads."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest

SHARED_CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "cifar10-jpeg.tar.gz"

warnings.filterwarnings("ignore", message="No loggers specified")


def pytest_configure(config):
    """One torch thread: the suite's models are tiny, and on a 2-core machine
    intra-op threads only contend (measured: a tiny-ViT round 35 s -> 0.9 s)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path_factory, monkeypatch):
    """Decoded-image caches go to a per-session folder, never the user's home."""
    monkeypatch.setenv("FEDAVAL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def cifar10_root(tmp_path_factory) -> Path:
    """A real subset of the shared CIFAR-10 (ImageFolder layout): 100 train and
    50 test images per class, extracted from ../shared/datasets."""
    if not SHARED_CIFAR10.exists():
        pytest.fail(f"shared CIFAR-10 missing at {SHARED_CIFAR10}")
    root = tmp_path_factory.mktemp("cifar10")
    subprocess.run(
        ["tar", "xzf", str(SHARED_CIFAR10), "-C", str(root), "--wildcards", "train/*/00[0-9][0-9].jpg",
         "test/*/00[0-4][0-9].jpg"],
        check=True,
    )
    return root


@pytest.fixture
def tiny_config(tmp_path):
    """A RunConfig factory for fast digits runs: ``tiny_config(plugins=[...], ...)``."""
    from helpers import tiny_run_config

    def make(**overrides):
        return tiny_run_config(overrides.pop("out", tmp_path / "run"), **overrides)

    return make
