"""The driver's handle on a Ray-hosted sidecar: start it (or re-attach to the one already running under the
run's name), wait for its endpoints, read its status, stop it.  Every call that waits on Ray is bounded
(``ray.call_timeout_s``, ``ray.ready_timeout_s``) and returns None on a timeout or Ray error, so an RL job
never fails because of its sidecar."""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Any

from draft_align.config import CotrainRecipe
from draft_align.integrations.ray.registry import RayNotifications, registry_actor
from draft_align.integrations.ray.runtime import (
    call,
    connect,
    get_actor,
    identity_of,
    import_ray,
    registry_name,
    sidecar_name,
    sign_endpoint,
)
from draft_align.wire.keys import resolve_key

log = logging.getLogger(__name__)


def _actor_options(recipe: CotrainRecipe) -> dict[str, Any]:
    rc = recipe.ray
    return {
        "name": sidecar_name(identity_of(recipe)),
        "namespace": rc.namespace,
        "lifetime": "detached" if rc.lifetime == "detached" else None,
        "get_if_exists": True,  # a second start (a restarted RL job) re-attaches
        "max_concurrency": 4,  # status/stop are answered while the loop runs on its own thread
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(recipe.sidecar.num_threads)}},
    }


class RaySidecar:
    """A sidecar on Ray (one :class:`~draft_align.integrations.ray.host.SidecarHost` actor, or for
    ``sidecar.ranks`` > 1 a :class:`~draft_align.integrations.ray.gang.SidecarGang` running a Ray Train gang),
    with the run's registry.  Build it with :meth:`start` or :meth:`attach`."""

    def __init__(self, recipe: CotrainRecipe, actor: Any, registry: Any) -> None:
        self.recipe = recipe
        self.actor = actor
        self.registry = registry
        self.timeout_s = float(recipe.ray.call_timeout_s)
        self.key = resolve_key(recipe.wire.key_file, recipe.run_dir, create=False)
        self.identity = identity_of(recipe)
        self.refused_endpoints = 0  # registry entries whose signature did not verify

    @property
    def ranks(self) -> int:
        return int(self.recipe.sidecar.ranks)

    @classmethod
    def start(cls, recipe: CotrainRecipe, start_draft: Path, recipe_file: Path) -> RaySidecar:
        """Create the run's registry and sidecar on the cluster (``ray.address``), or get them when they exist.
        ``recipe_file``: the resolved recipe, on storage every node can read (the run folder)."""
        rc = recipe.ray
        ray = connect(rc.address, rc.namespace)
        resolve_key(recipe.wire.key_file, recipe.run_dir, create=True)  # the run's identity derives from it
        registry = registry_actor(
            recipe.run_dir,
            recipe.run,
            rc.namespace,
            identity=identity_of(recipe),
            detached=rc.lifetime == "detached",
        )
        opts = _actor_options(recipe)
        if recipe.sidecar.ranks > 1:
            from draft_align.integrations.ray.gang import SidecarGang

            actor = (
                ray.remote(SidecarGang)
                .options(**opts, num_cpus=0, max_restarts=rc.max_restarts, max_task_retries=0)
                .remote(str(recipe_file), str(start_draft), rc.namespace)
            )
        else:
            from draft_align.integrations.ray.host import SidecarHost

            actor = (
                ray.remote(SidecarHost)
                .options(
                    **opts,
                    num_cpus=rc.num_cpus,
                    num_gpus=rc.num_gpus,
                    resources=dict(rc.resources),
                    max_restarts=rc.max_restarts,
                    max_task_retries=0,
                )
                .remote(str(recipe_file), str(start_draft), rc.namespace)
            )
        return cls(recipe, actor, registry)

    @classmethod
    def attach(cls, recipe: CotrainRecipe) -> RaySidecar | None:
        """The run's running sidecar (by name, in ``ray.namespace``), or None when there is none."""
        rc = recipe.ray
        connect(rc.address, rc.namespace)
        try:  # this run folder's identity: another folder's run of the same name is not found
            identity = identity_of(recipe)
        except (OSError, ValueError):  # no key in this folder: it started no sidecar
            return None
        actor = get_actor(sidecar_name(identity), rc.namespace)
        if actor is None:
            return None
        return cls(recipe, actor, get_actor(registry_name(identity), rc.namespace))

    # ----------------------------------------------------------------- what the RL side asks
    def ready(self, timeout_s: float | None = None) -> list[str] | None:
        """The tap endpoints by rank once every rank has bound its socket; None after ``timeout_s`` (default
        ``ray.ready_timeout_s``) or when the sidecar failed to start (logged: the RL job runs on without it)."""
        timeout_s = float(self.recipe.ray.ready_timeout_s if timeout_s is None else timeout_s)
        info = call(self.actor.ready.remote(), timeout_s, "sidecar ready()")
        if info is None:
            return None
        if self.ranks == 1:
            return list(info["endpoints"])
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:  # the gang's ranks register one by one
            status = call(self.actor.status.remote(), self.timeout_s, "sidecar gang status()")
            if status is not None and status.get("error"):
                log.warning("sidecar gang failed: %s", status["error"])
                return None
            eps = self.endpoints()
            if eps is not None and len(eps) == self.ranks:
                return eps
            time.sleep(0.2)
        log.warning("sidecar gang: not every rank registered within %.0f s", timeout_s)
        return None

    def endpoints(self) -> list[str] | None:
        """The registry's current tap endpoints in rank order, each checked against the signature its rank
        announced it with (None: unknown, some rank not registered since the gang's last start, or an entry
        that does not verify: counted in ``refused_endpoints``, logged)."""
        if self.registry is None:
            return None
        signed = call(self.registry.signed_endpoints.remote(), self.timeout_s, "registry signed_endpoints()")
        if not signed or sorted(signed) != list(range(len(signed))):
            return None
        out = []
        for rank in range(len(signed)):
            endpoint, mac = signed[rank]
            if not hmac.compare_digest(str(mac), sign_endpoint(self.key, self.identity, rank, str(endpoint))):
                self.refused_endpoints += 1
                log.warning(
                    "draft registry: rank %d's endpoint %s is not signed by this run's key: refused",
                    rank,
                    endpoint,
                )
                return None
            out.append(str(endpoint))
        return out

    def status(self) -> dict[str, Any] | None:
        """The sidecar's status (None when it cannot be reached within ``ray.call_timeout_s``)."""
        return call(self.actor.status.remote(), self.timeout_s, "sidecar status()")

    def alive(self) -> bool:
        status = self.status()
        return status is not None and bool(status.get("running"))

    def notifications(self) -> RayNotifications:
        """The RL side's DraftPublished source on the registry (``rl/drafts.py``'s Notifications)."""
        return RayNotifications(self.identity, self.recipe.ray.namespace, timeout_s=self.timeout_s)

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Wait up to ``timeout_s`` for the loop to end on its own (after the RL job's final report: it
        publishes once more first); the last status seen (None if unreachable)."""
        end = time.monotonic() + timeout_s
        status = self.status()
        while status is not None and status.get("running") and time.monotonic() < end:
            time.sleep(0.5)
            status = self.status()
        return status

    def stop(self, timeout_s: float = 120.0, *, kill: bool = True) -> dict[str, Any] | None:
        """Let the loop end (checkpoint, close) within ``timeout_s``, then, with ``kill``, remove the actors
        (a detached sidecar outlives its driver until this).  Returns the final status (None if unreachable)."""
        ray = import_ray()
        final = call(self.actor.stop.remote(timeout_s), timeout_s + self.timeout_s, "sidecar stop()")
        if kill:
            for actor in (self.actor, self.registry):
                if actor is None:
                    continue
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as e:  # already gone
                    log.info("draft_align on Ray: kill: %s", e)
        return final
