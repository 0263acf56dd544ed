"""The one place that imports Ray (lazily: importing draft_align never imports or starts Ray), joining a
running cluster (never starting one), the per-run actor names and bounded calls."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any

log = logging.getLogger(__name__)

RAY_EXTRA = "draft-align[ray]"


class RayUnavailableError(ImportError):
    """Ray is not installed."""


class RayConnectError(RuntimeError):
    """No Ray cluster could be joined."""


def import_ray() -> Any:
    """The ``ray`` module; RayUnavailableError (one line naming the extra) when it is not installed."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailableError(
            f"sidecar.host=ray needs Ray, which is not installed ({e}): pip install '{RAY_EXTRA}'"
        ) from e
    return ray


def import_ray_train() -> Any:
    """``ray.train`` (Ray Train, in the same extra)."""
    import_ray()
    try:
        from ray import train
    except ImportError as e:
        raise RayUnavailableError(
            f"a multi-rank sidecar on Ray needs Ray Train ({e}): pip install '{RAY_EXTRA}'"
        ) from e
    return train


def import_ray_train_torch() -> Any:
    """``ray.train.torch`` (``TorchTrainer``, ``TorchConfig``)."""
    import_ray_train()
    from ray.train import torch as train_torch

    return train_torch


def connect(address: str | None, namespace: str) -> Any:
    """Join a running Ray cluster and return ``ray``: the one this process is already connected to (an RL
    job's driver), else ``address`` (None: ``"auto"``, i.e. ``$RAY_ADDRESS`` or the cluster started on this
    node by ``ray start``).  Never starts a cluster: RayConnectError (one line) when none is reachable."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    refused = _unreachable(where)
    if refused is not None:  # ray.init would retry for minutes
        raise RayConnectError(
            f"no Ray cluster reachable at {where!r} ({refused}): start one (ray start --head) or set ray.address"
        )
    try:
        ray.init(address=where, namespace=namespace, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RayConnectError(
            f"no Ray cluster reachable at {where!r} ({first}): start one (ray start --head) or set ray.address"
        ) from e
    return ray


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a ``host:port`` (or ``ray://host:port``) address cannot be reached by tcp within ``timeout_s``; None
    when it can or when the address is not of that form (``auto``: Ray finds the local cluster itself)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"tcp connect: {e.strerror or e}"
    return None


def sidecar_name(run: str) -> str:
    """The sidecar actor's name (a single rank's actor, or the gang's supervisor) in the run's namespace."""
    return f"draft_align.sidecar.{run}"


def registry_name(run: str) -> str:
    """The registry actor's name in the run's namespace."""
    return f"draft_align.registry.{run}"


def node_ip() -> str:
    """This worker's node address as Ray knows it (what the other nodes reach it by)."""
    ray = import_ray()
    return str(ray.util.get_node_ip_address())


def tcp_endpoint(host: str, port: int | str = "*") -> str:
    """``tcp://host:port`` (IPv6 in brackets); ``*``: any free port, resolved when bound."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def call(ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get(ref)`` within ``timeout_s``; None (logged) on a timeout or any Ray error — the RL side never
    fails because of the sidecar."""
    ray = import_ray()
    try:
        return ray.get(ref, timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:
        log.warning("draft_align on Ray: %s failed (%s)", what, brief(e))
        return None


def brief(e: BaseException) -> str:
    """A Ray error in one line: its type and the last line of its text (where the remote exception is)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def get_actor(name: str, namespace: str) -> Any | None:
    """The named actor, or None when there is none (never started, stopped, or out of restarts)."""
    ray = import_ray()
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
