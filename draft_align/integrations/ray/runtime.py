"""The one place that imports Ray (lazily: importing draft_align never imports or starts Ray), joining a
running cluster (never starting one), the per-run actor names and bounded calls."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
from pathlib import Path
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
    auth_error = getattr(getattr(ray, "exceptions", None), "AuthenticationError", ())
    try:
        ray.init(address=where, namespace=namespace, log_to_driver=False)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if (auth_error and isinstance(e, auth_error)) or _looks_like_auth(first):
            raise RayConnectError(
                f"the Ray cluster at {where!r} is reachable but refused this client's authentication ({first[:200]}): "
                f"set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH "
                f"names) as the cluster was started with"
            ) from e
        if not isinstance(e, ConnectionError | RuntimeError | ValueError):
            raise
        target = _resolved(where)
        if _host_port(target) is not None and _unreachable(target) is None:
            # Ray 2.60 raises a bare "Failed to connect" for a token-auth cluster that refused this client (the
            # reason is only in its C++ log): something answers on the port, so "unreachable" would be wrong
            raise RayConnectError(
                f"the Ray cluster at {target!r} answers on its port but this client could not join ({first[:200]}): "
                f"if it was started with token authentication, set RAY_AUTH_MODE=token and its token "
                f"(RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH names)"
            ) from e
        raise RayConnectError(
            f"no Ray cluster reachable at {where!r} ({first}): start one (ray start --head) or set ray.address"
        ) from e
    return ray


def _looks_like_auth(text: str) -> bool:
    """An error of Ray's token authentication, by its words (versions differ in the type they raise)."""
    low = text.lower()
    return "auth" in low and ("token" in low or "unauthenticated" in low or "authentication" in low)


def _resolved(address: str) -> str:
    """``auto`` as Ray resolves it (``$RAY_ADDRESS``, else the cluster ``ray start`` left on this node), for the
    error message only; the address itself when Ray cannot say."""
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address  # a private helper: best effort

        return canonicalize_bootstrap_address("auto") or address
    except Exception:  # noqa: BLE001 - any failure: keep "auto"
        return address


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` or ``ray://host:port`` address; None for any other form (``auto``)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a ``host:port`` (or ``ray://host:port``) address cannot be reached by tcp within ``timeout_s``; None
    when it can or when the address is not of that form (``auto``: Ray finds the local cluster itself)."""
    hp = _host_port(address)
    if hp is None:
        return None
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except OSError as e:
        return f"tcp connect: {e.strerror or e}"
    return None


def run_identity(run: str, run_dir: Path, key: bytes) -> str:
    """What a run's actors are named by: ``<run>.<16 hex>``, the run's name and an HMAC of its resolved run
    folder under the run's wire key.  Two jobs of one recipe in two output folders, or a job that only knows
    the run's name, never reach each other's sidecar (``draft-align ray stop`` from another folder used to
    stop another job's sidecar and registry)."""
    tag = hmac.new(key, str(Path(run_dir).resolve()).encode(), hashlib.sha256).hexdigest()[:16]
    return f"{run}.{tag}"


def identity_of(recipe: Any) -> str:
    """:func:`run_identity` of a co-training recipe (its run folder's key: ``wire.key_file``,
    ``$DRAFT_ALIGN_WIRE_KEY`` or ``<run>/wire.key``, which must exist)."""
    from draft_align.wire.keys import resolve_key

    return run_identity(
        recipe.run, recipe.run_dir, resolve_key(recipe.wire.key_file, recipe.run_dir, create=False)
    )


def sign_endpoint(key: bytes, identity: str, rank: int, endpoint: str) -> str:
    """The registry entry's MAC: a rank's endpoint announced under the run's key (a job on the cluster can
    call the registry, but cannot sign an endpoint to redirect the Tap's data to)."""
    return hmac.new(key, f"{identity}|{int(rank)}|{endpoint}".encode(), hashlib.sha256).hexdigest()


def sidecar_name(identity: str) -> str:
    """The sidecar actor's name (a single rank's actor, or the gang's supervisor) in the run's namespace."""
    return f"draft_align.sidecar.{identity}"


def registry_name(identity: str) -> str:
    """The registry actor's name in the run's namespace."""
    return f"draft_align.registry.{identity}"


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
