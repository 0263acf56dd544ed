"""``draft-align ray start|status|stop RECIPE``: a sidecar on a Ray cluster, detached from any RL driver, so
that RL jobs (``sidecar: ray`` in the TRL session, ``sidecar.host=ray`` in cotrain, with ``ray.lifetime:
detached``) re-attach to it by its run name (docs/ray.md)."""

from __future__ import annotations

import argparse
import json

from draft_align.cli.runs import _cotrain_recipe


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def cmd_ray(args: argparse.Namespace) -> int:
    from draft_align.config import RESOLVED_RECIPE, save_recipe
    from draft_align.integrations.ray.client import RaySidecar
    from draft_align.integrations.ray.runtime import identity_of, registry_name, sidecar_name
    from draft_align.wire import channel

    recipe = _cotrain_recipe(args)
    rc = recipe.ray
    if args.action == "start":
        from draft_align import warmstart
        from draft_align.sidecar.launch import starting_draft

        recipe.ray.lifetime = type(rc.lifetime)("detached")  # it must outlive this command
        start = starting_draft(recipe, args.draft, warm_start=warmstart.run_in_process)
        recipe.run_dir.mkdir(parents=True, exist_ok=True)
        channel.resolve_key(recipe.wire.key_file, recipe.run_dir, create=True)  # a file on shared storage
        resolved = save_recipe(recipe, recipe.run_dir / RESOLVED_RECIPE)
        identity = identity_of(recipe)
        sidecar = RaySidecar.start(recipe, start, resolved)
        endpoints = sidecar.ready()
        if endpoints is None:
            raise RuntimeError(
                f"the sidecar {sidecar_name(identity)} did not become ready within {rc.ready_timeout_s:.0f} s: "
                f"see its log (ray logs, or the Ray dashboard) and stop it with draft-align ray stop {args.recipe}"
            )
        _print({"sidecar": sidecar_name(identity), "namespace": rc.namespace, "endpoints": endpoints})
        return 0
    sidecar = RaySidecar.attach(recipe)  # joins the cluster first: Ray missing, no cluster: one line each
    try:
        identity = identity_of(recipe)
    except (OSError, ValueError):
        identity = f"{recipe.run}.<no wire key in {recipe.run_dir}>"
    if sidecar is None:
        raise RuntimeError(
            f"no sidecar {sidecar_name(identity)} of run folder {recipe.run_dir} in Ray namespace "
            f"{rc.namespace!r} (start one: draft-align ray start {args.recipe})"
        )
    if args.action == "status":
        status = sidecar.status()
        if status is None:
            raise RuntimeError(
                f"the sidecar {sidecar_name(identity)} did not answer within {rc.call_timeout_s} s"
            )
        _print({"status": status, "endpoints": sidecar.endpoints(), "registry": registry_name(identity)})
        return 0
    final = sidecar.stop(args.timeout, kill=True)
    _print({"stopped": sidecar_name(identity), "final_status": final})
    return 0
