"""Fixtures shared by the tests (helpers live in tests/helpers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers import SMALL
from helpers import compose_config


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers on two cores) each worker takes one
    torch thread: two workers of two threads each would contend for the cores.

    The suite's ``fedexp`` subprocesses draw their figures in their own process
    (``FEDEXP_FIGURE_HELPER=0``): the workers already fill the cores that a run's figures'
    helper would count as idle. tests/test_drawer.py turns the helper on where it tests it.
    """
    import os

    os.environ.setdefault("FEDEXP_FIGURE_HELPER", "0")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Put torch's threads back after each test: an in-process ``fedexp run`` sets them
    (fedexp/engine/threads.py), which would leak into the worker's later tests."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One intra-op torch thread: tiny models take many small steps, which crawl when two
    threads contend on a busy 2-core machine (``pytestmark = usefixtures("one_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def small_cfg(tmp_path):
    """Compose a tiny run writing into tmp_path."""

    def make(*overrides: str):
        return compose_config(*SMALL, *overrides, output_dir=tmp_path / "out")

    return make


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> SimpleNamespace:
    """Synthetic LUNA16 and BraTS releases converted by data_prep, in-process; look-alike
    MNIST, CIFAR-10/100 and Tiny ImageNet files in their official formats."""
    from data_prep import brats as brats_prep
    from data_prep import luna16 as luna_prep
    from data_prep import synthetic
    from data_prep import synthetic_images as images
    from data_prep.brats import BratsOptions
    from data_prep.luna16 import LunaOptions

    root = tmp_path_factory.mktemp("imaging")
    synthetic.write_luna16(root / "luna_raw", n_studies=6, seed=0)
    luna_prep.convert(root / "luna_raw", root / "luna", LunaOptions(quiet=True))
    synthetic.write_brats(root / "brats_raw", "brats2017", n_studies=5, seed=0)
    brats_prep.convert(root / "brats_raw", root / "brats", BratsOptions(quiet=True))
    regions = BratsOptions(quiet=True, labels="regions")
    brats_prep.convert(root / "brats_raw", root / "brats_regions", regions)
    return SimpleNamespace(
        luna=root / "luna",
        brats=root / "brats",
        brats_regions=root / "brats_regions",
        mnist=images.write_mnist(root / "mnist", n_train=100, n_test=40),
        cifar10=images.write_cifar10(root / "cifar10", per_file=20),
        cifar100=images.write_cifar100(root / "cifar100", n_train=300, n_test=100),
        tiny_imagenet=images.write_tiny_imagenet(root / "tiny", classes=4, train_per_class=8),
    )
