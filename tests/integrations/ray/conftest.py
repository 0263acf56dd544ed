"""A real local Ray cluster per test module, bound to 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set before
Ray starts, else its workers use the machine's other interface), object store capped, no dashboard, no usage
statistics; the actors import this checkout's draft_align."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# RAY_worker_niceness=0: Ray's workers keep the test's own priority (Ray adds 15 by default, which starves them on
# a shared, loaded machine: an actor took minutes to import torch)
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_worker_niceness": "0",
}
os.environ.update(RAY_ENV)  # before Ray is imported: it reads them at import

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[3]


def worker_env(home: Path | None = None) -> dict[str, str]:
    """What every Ray worker of a test gets: this checkout first on its path, one thread, the test's caches."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if home is not None:
        env["DRAFT_ALIGN_HOME"] = str(home)
    return env


@contextmanager
def local_cluster(home: Path | None, num_cpus: int = 4) -> Iterator[str]:
    """``ray.init`` of a fresh local cluster (``num_cpus`` logical CPUs) for the ``with`` block; yields its
    unique namespace."""
    os.environ.update(RAY_ENV)
    namespace = f"da-test-{uuid.uuid4().hex[:8]}"
    ray.init(
        num_cpus=num_cpus,
        object_store_memory=80 << 20,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        log_to_driver=False,
        runtime_env={"env_vars": worker_env(home)},
    )
    try:
        yield namespace
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(tiny_world):
    """A local cluster for this module (:func:`local_cluster`); yields its namespace."""
    with local_cluster(tiny_world.home) as namespace:
        yield namespace


@pytest.fixture
def feeder_cls():
    """The sidecar tests' policy side (tests/sidecar/conftest.py)."""
    from tests.sidecar.conftest import Feeder

    return Feeder
