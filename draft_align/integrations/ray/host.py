"""One sidecar rank hosted by Ray: the wire bound on the node's address, endpoints and publishes reported to the
registry, and :class:`SidecarHost`, the single-rank sidecar actor.

The actor's constructor builds the sidecar (``sidecar/loop.py``) from the resolved recipe on shared storage and
starts its loop on a thread; Ray restarts a dead actor (``ray.max_restarts``) by running the constructor
again, which resumes from the run folder like any restarted sidecar (``sidecar/resume.py``: the newest
checkpoint, published versions that verify, half-written ones discarded).  A restarted rank binds the port it
had when that port is free on the same node, so the Tap's connection to it comes back by itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from draft_align.config import CotrainRecipe, load_recipe
from draft_align.integrations.ray.registry import read_endpoints
from draft_align.integrations.ray.runtime import (
    get_actor,
    identity_of,
    import_ray,
    node_ip,
    registry_name,
    sign_endpoint,
    tcp_endpoint,
)
from draft_align.wire.messages import DraftPublished

log = logging.getLogger(__name__)


def _port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, as ZeroMQ's listener sets it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _previous_port(run_dir: Path, rank: int, host: str) -> int | None:
    """The port rank ``rank`` bound last on this node (from the run folder), if it is free again."""
    previous = read_endpoints(run_dir).get(rank)
    if previous is None or not previous.startswith("tcp://"):
        return None
    where, _, port = previous[len("tcp://") :].rpartition(":")
    if where.strip("[]") != host or not port.isdigit():
        return None
    return int(port) if _port_free(host, int(port)) else None


def bind_on_node(recipe: CotrainRecipe, rank: int, ranks: int) -> str:
    """Point the recipe's wire at this node: the tap endpoint ``tcp://<node ip>:<port>`` (the port this rank had
    before when free, else any free one) and the DraftPublished socket on any free port.  Returns the node ip.
    The recipe's ``wire.allow_remote`` must be set when the node address is not loopback (a clear error
    otherwise, from the wire's own check)."""
    ip = node_ip()
    port = _previous_port(recipe.run_dir, rank, ip)
    if port is not None and port - rank > 0:
        # rank r binds the base port + r (wire/endpoints.py): the base that gives this rank its old port
        recipe.wire.endpoint = tcp_endpoint(ip, port - rank if ranks > 1 else port)
    else:
        recipe.wire.endpoint = tcp_endpoint(ip)
    recipe.wire.notify_endpoint = tcp_endpoint(ip)
    return ip


class RegistryPublisher:
    """The lead rank's DraftPublished publisher: the wire's PUB socket and, fire-and-forget, the registry (a
    failure there is logged; ``latest`` on disk stays the source of truth)."""

    def __init__(self, inner: Any, registry: Any) -> None:
        self.inner = inner
        self.registry = registry
        self.forwarded = 0
        self.failed = 0

    def publish(self, msg: DraftPublished) -> None:
        if self.inner is not None:
            self.inner.publish(msg)
        if self.registry is None:
            return
        try:
            self.registry.published.remote(msg)
            self.forwarded += 1
        except Exception as e:  # the registry is gone: the RL side reads `latest`
            self.failed += 1
            log.warning("registry not told of v%04d: %s", msg.draft_version, e)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def attach_registry(sidecar: Any, recipe: Any, namespace: str, rank: int) -> Any:
    """Register ``sidecar``'s bound tap endpoint under ``rank``, signed with the run's key, and, on the lead
    rank, report its publishes; returns the registry handle (None when there is none: the sidecar serves
    anyway)."""
    from draft_align.wire.keys import resolve_key

    run = recipe.run
    identity = identity_of(recipe)
    registry = get_actor(registry_name(identity), namespace)
    if registry is None:
        log.warning(
            "no draft registry for run %s in namespace %s: endpoints and publishes not reported",
            run,
            namespace,
        )
        return None
    info = {
        "pid": os.getpid(),
        "resumed": bool(sidecar.resumed),
        "train_steps": int(sidecar.state.train_steps),
    }
    key = resolve_key(recipe.wire.key_file, recipe.run_dir, create=False)
    endpoint = sidecar.receiver.endpoint
    registry.register.remote(rank, endpoint, info, sign_endpoint(key, identity, rank, endpoint))
    if sidecar.is_lead:
        sidecar.gate.publisher = RegistryPublisher(sidecar.gate.publisher, registry)
    return registry


def weights_digest(module: Any) -> str:
    """sha256 over a module's parameters (name, dtype, shape, bytes) in name order: equal iff bit-equal."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SidecarHost:
    """A single-rank sidecar as a Ray actor (see the module docstring).  ``recipe_file``: the resolved recipe
    on storage the node can read; ``start_draft``: the draft co-training starts from."""

    def __init__(self, recipe_file: str, start_draft: str, namespace: str) -> None:
        import torch

        from draft_align.sidecar.launch import starting_draft
        from draft_align.sidecar.loop import Sidecar

        ray = import_ray()
        context = ray.get_runtime_context()
        self.reconstructed = bool(context.was_current_actor_reconstructed)
        self.node_id = str(context.get_node_id())
        recipe = load_recipe(recipe_file, [], CotrainRecipe)
        torch.set_num_threads(recipe.sidecar.num_threads)  # this actor is its own process
        torch.manual_seed(recipe.seed)
        self.node_ip = bind_on_node(recipe, rank=0, ranks=1)
        self.recipe = recipe
        self.stop_event = threading.Event()
        start = starting_draft(recipe, start_draft)
        self.sidecar = Sidecar(recipe, start, exit_when_done=True, stop=self.stop_event).setup()
        self.registry = attach_registry(self.sidecar, recipe, namespace, 0)
        self.error: str | None = None
        self.started = time.time()
        if self.reconstructed:
            log.warning(
                "sidecar actor restarted by Ray: resumed at train step %d", self.sidecar.state.train_steps
            )
        self.thread = threading.Thread(target=self._loop, name="draft_align-sidecar", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            self.sidecar.run()
        except BaseException as e:  # reported by status(); the actor stays up for inspection
            self.error = f"{type(e).__name__}: {e}"
            log.exception("sidecar loop failed")

    def ready(self) -> dict[str, Any]:
        """Bound and loaded: ``{"endpoints": [tap endpoint], "notify_endpoint", "node_ip", "pid", …}``."""
        sc = self.sidecar
        return {
            "endpoints": [sc.receiver.endpoint],
            "notify_endpoint": getattr(sc.gate.publisher.inner, "endpoint", None)
            if isinstance(sc.gate.publisher, RegistryPublisher)
            else None,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "reconstructed": self.reconstructed,
            "resumed": bool(sc.resumed),
            "draft_version": int(sc.state.published_version),
        }

    def status(self) -> dict[str, Any]:
        """The loop's progress (plain counters of its state, read without locking)."""
        st = self.sidecar.state
        return {
            "running": self.thread.is_alive(),
            "done": bool(st.done),
            "error": self.error,
            "pid": os.getpid(),
            "reconstructed": self.reconstructed,
            "resumed": bool(self.sidecar.resumed),
            "restarts": int(st.restarts),
            "train_steps": int(st.train_steps),
            "published_version": int(st.published_version),
            "last_step_report": int(st.last_step_report),
            "ingested_messages": int(st.ingested_messages),
            "ingested_tokens": int(st.ingested_tokens),
            "endpoints": [self.sidecar.receiver.endpoint],
            "up_s": time.time() - self.started,
        }

    def weights_digest(self) -> str:
        """:func:`weights_digest` of the draft being trained."""
        return weights_digest(self.sidecar.trainer.draft)

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """End the loop (it checkpoints and closes) and return the final status."""
        self.stop_event.set()
        self.thread.join(timeout_s)
        return self.status()
