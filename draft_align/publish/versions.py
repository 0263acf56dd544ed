"""A run's published versions: ``drafts/vNNNN`` folders, the ``latest`` pointer, and publishing one more.

Layout inside a run folder (docs/formats.md §4)::

    run_dir/drafts/v0007/      a published draft (config.json, model.safetensors, manifest.json)
    run_dir/adapters/v0007/    optional: the same version's adapter-only delta (LoRA runs)
    run_dir/latest             text file: "drafts/v0007"

:func:`publish_version` is the one way both loops (warm-start and sidecar) publish: next version →
export → ``latest`` → optional delta.  A publish that fails (a full disk: ``OSError``; an export refused:
``ExportError``) leaves no folder behind and ``latest`` where it was.

A version's number is its folder's name (``v0007`` is version 7); a manifest whose ``draft_version`` says
otherwise is refused (:func:`check_folder_version`), so an edited manifest cannot jump ahead of genuine later
versions.  :func:`prune_versions` keeps the newest ``keep`` versions and the one ``latest`` names.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_align.conventions import MAX_VERSION
from draft_align.heads.draft_head import DraftHead
from draft_align.heads.lora import AdapterMismatchError
from draft_align.publish import write_draft
from draft_align.publish.folder import MANIFEST_FILE, ExportError, ExportRequest, fsync_path, weights_sha256
from draft_align.publish.lora_delta import export_adapter
from draft_align.storage import SHARED_FILE_MODE

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
DRAFTS_DIR = "drafts"
ADAPTERS_DIR = "adapters"
_VERSION_RE = re.compile(r"^v(\d{4,})$")


def version_dir(run_dir: Path, version: int) -> Path:
    """``run_dir/drafts/v{version:04d}``."""
    return Path(run_dir) / DRAFTS_DIR / f"v{int(version):04d}"


def adapter_dir(run_dir: Path, version: int) -> Path:
    """``run_dir/adapters/v{version:04d}``: the adapter-only delta published beside version ``version``."""
    return Path(run_dir) / ADAPTERS_DIR / f"v{int(version):04d}"


def next_version(run_dir: Path) -> int:
    """One more than the highest ``drafts/vNNNN`` folder (1 when there is none; ``.tmp-*`` are ignored)."""
    drafts = Path(run_dir) / DRAFTS_DIR
    if not drafts.is_dir():
        return 1
    found = [v for p in drafts.iterdir() if p.is_dir() and (v := folder_version(p)) is not None]
    return max(found, default=0) + 1


def folder_version(path: Path) -> int | None:
    """The version a ``vNNNN`` folder's name gives (None for a folder not named so, e.g. a starting draft, or
    for a number past :data:`~draft_align.conventions.MAX_VERSION`, which no version can have)."""
    m = _VERSION_RE.match(Path(path).name)
    if m is None or len(m.group(1)) > len(str(MAX_VERSION)):
        return None
    v = int(m.group(1))
    return v if v <= MAX_VERSION else None


def check_folder_version(path: Path, manifest: dict[str, Any]) -> int | None:
    """The version of the published folder ``path``: its name's number, which its manifest's ``draft_version``
    must equal (ExportError otherwise); None for a folder not named ``vNNNN``."""
    want = folder_version(path)
    if want is None:
        return None
    got = manifest.get("draft_version")
    if isinstance(got, bool) or not isinstance(got, int) or got != want:
        raise ExportError(
            f"{path}: manifest says draft_version {got!r}, the folder is version {want}: refused"
        )
    return want


def run_version_dir(run_dir: Path, path: Path, version: int | None = None) -> Path:
    """``run_dir/drafts/vNNNN`` when ``path`` is that folder of ``run_dir`` (version ``version``, else the
    version ``path``'s name gives) with no symbolic link leading elsewhere; ExportError (one line) otherwise,
    e.g. for a notification naming a folder outside the run or a ``drafts/vNNNN`` linked out of it."""
    run_dir, path = Path(run_dir), Path(path)
    v = folder_version(path) if version is None else int(version)
    if v is None:
        raise ExportError(f"{path} is not a vNNNN folder of {run_dir / DRAFTS_DIR}: refused")
    want = version_dir(run_dir, v)
    try:
        real, real_want = path.resolve(), want.resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        raise ExportError(f"{path}: cannot be resolved ({e})") from None
    if real_want != run_dir.resolve() / DRAFTS_DIR / want.name or real != real_want:
        raise ExportError(
            f"{path} is not {want} of this run (it resolves to {real}; a path or link out of the run): refused"
        )
    if not real.is_dir():
        raise ExportError(f"{want} does not exist")
    return want


def published_versions(run_dir: Path) -> list[Path]:
    """The run's ``drafts/vNNNN`` folders, newest first (whether they verify is the caller's check)."""
    drafts = Path(run_dir) / DRAFTS_DIR
    if not drafts.is_dir():
        return []
    found = [(v, p) for p in drafts.iterdir() if p.is_dir() and (v := folder_version(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def prune_versions(run_dir: Path, keep: int, protect: tuple[Path, ...] = ()) -> list[int]:
    """Delete all but the newest ``keep`` ≥ 1 versions (and their adapter deltas), never the one ``latest``
    names nor any folder in ``protect``; returns the versions deleted.  Each goes first to a ``.tmp-`` name
    (gone from readers at once; a kill mid-delete leaves only what :func:`discard_tmp_versions` removes)."""
    if keep < 1:
        raise ValueError(f"keep must be ≥ 1, got {keep}")
    run_dir = Path(run_dir)
    try:
        latest = read_latest(run_dir)
    except ExportError:
        latest = None
    keep_paths = {p.resolve() for p in protect if p is not None}
    if latest is not None:
        keep_paths.add(latest.resolve())
    deleted = []
    for p in published_versions(run_dir)[keep:]:
        if p.resolve() in keep_paths:
            continue
        v = folder_version(p)
        assert v is not None
        for folder in (p, adapter_dir(run_dir, v)):
            if folder.is_dir():
                gone = folder.with_name(f".tmp-prune-{folder.name}")
                os.replace(folder, gone)
                shutil.rmtree(gone, ignore_errors=True)
        deleted.append(v)
    if deleted:
        log.info(
            "retention: deleted draft versions %s (keeping the newest %d and latest)", sorted(deleted), keep
        )
    return deleted


def discard_tmp_versions(run_dir: Path) -> None:
    """Remove temp folders that a publish killed mid-write left behind (never visible as versions)."""
    for sub in (DRAFTS_DIR, ADAPTERS_DIR):
        folder = Path(run_dir) / sub
        if folder.is_dir():
            for p in folder.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)


def write_latest(run_dir: Path, version_dir: Path) -> None:
    """Point ``run_dir/latest`` at ``version_dir`` (which must be a checkpoint inside ``run_dir``).

    ``latest`` is a one-line text file holding the folder's path relative to ``run_dir``, replaced
    atomically (temp file + fsync + ``os.replace``).  A symlink is not used: symlinks are fragile across
    filesystems (object-store mounts, some network filesystems, copies to another machine or into a
    container at another path) and a relative text pointer survives all of them.
    """
    run_dir, version_dir = Path(run_dir), Path(version_dir)
    try:
        rel = version_dir.resolve().relative_to(run_dir.resolve())
    except ValueError as e:
        raise ExportError(f"{version_dir} is not inside {run_dir}") from e
    if not (version_dir / MANIFEST_FILE).is_file():
        raise ExportError(f"{version_dir} is not a published checkpoint (no {MANIFEST_FILE})")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LATEST_FILE}.tmp-", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(rel.as_posix() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, SHARED_FILE_MODE)
        os.replace(tmp_name, run_dir / LATEST_FILE)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    fsync_path(run_dir)


def read_latest(run_dir: Path) -> Path | None:
    """The folder ``run_dir/latest`` names, or None when nothing has been published yet.  ExportError (one
    line) for a ``latest`` that is not a UTF-8 text file naming a folder inside ``run_dir``."""
    run_dir = Path(run_dir)
    path = run_dir / LATEST_FILE
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ExportError(f"{path} is a directory: expected a text file naming a published folder") from None
    except UnicodeDecodeError as e:
        raise ExportError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    rel = Path(text)
    if not text or "\x00" in text or rel.is_absolute() or ".." in rel.parts:
        raise ExportError(
            f"{run_dir / LATEST_FILE} holds {text!r}: expected a folder path relative to {run_dir}"
        )
    target = run_dir / rel
    if not target.is_dir():
        raise ExportError(f"{run_dir / LATEST_FILE} names {text!r}, which does not exist")
    try:
        target.resolve().relative_to(run_dir.resolve())
    except ValueError:
        raise ExportError(
            f"{run_dir / LATEST_FILE} names {text!r}, a link to {target.resolve()} outside {run_dir}: refused"
        ) from None
    return target


def resolve_draft_dir(path: Path) -> Path:
    """A published draft folder, or the folder a run folder's ``latest`` names (ExportError otherwise)."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return path
    latest = read_latest(path) if path.is_dir() else None
    if latest is None:
        raise ExportError(f"{path} is neither a draft folder (no {MANIFEST_FILE}) nor a run with a `latest`")
    return latest


# --------------------------------------------------------------------------------------- publish
@dataclass(frozen=True)
class Published:
    """One version :func:`publish_version` made visible."""

    version: int
    path: Path  # run_dir/drafts/vNNNN
    manifest: dict[str, Any]  # as written, ``files`` included
    weights_sha256: str  # of path/model.safetensors
    delta_path: Path | None = None  # run_dir/adapters/vNNNN, when a delta was asked for and written


def publish_version(
    run_dir: Path,
    draft: DraftHead,
    *,
    target_config: Any,
    target_name: str,
    tokenizer_fingerprint: str,
    metrics: dict[str, Any],
    policy_version: int,
    extra_manifest: dict[str, Any] | None = None,
    at_least: int = 1,
    delta_base: Path | None = None,
    strict_delta: bool = True,
) -> Published:
    """Publish ``draft`` as the run's next version: export it (bf16, HF dialect) to
    ``drafts/v{max(next_version, at_least):04d}``, point ``latest`` at it, then, when ``delta_base`` is
    given, write the adapters alone over that base draft to ``adapters/vNNNN`` (same metrics).

    ``strict_delta=False`` turns a delta that cannot be written (AdapterMismatchError, ExportError) into a
    logged warning and ``delta_path=None``; the version itself stays published.
    """
    v = max(next_version(run_dir), int(at_least))
    if v > MAX_VERSION:  # checked before anything is written: the wire could not announce it
        raise ExportError(
            f"draft version {v} is past the last one the wire can carry (2^63 - 1): not published"
        )
    out = version_dir(run_dir, v)
    req = ExportRequest(
        target_config=target_config,
        target_name=target_name,
        metrics=metrics,
        draft_version=v,
        policy_version=policy_version,
        tokenizer_fingerprint=tokenizer_fingerprint,
        extra_manifest=extra_manifest,
    )
    manifest = write_draft(draft, out, req)  # leaves no temp folder when it fails
    try:
        write_latest(run_dir, out)
    except BaseException:
        # never announced: no folder may stay that `latest` does not name and a later publish would skip
        gone = out.with_name(f".tmp-failed-{out.name}")
        os.replace(out, gone)
        shutil.rmtree(gone, ignore_errors=True)
        raise
    delta: Path | None = None
    if delta_base is not None:
        try:
            info = export_adapter(
                draft,
                adapter_dir(run_dir, v),
                Path(delta_base),
                draft_version=v,
                policy_version=policy_version,
                metrics=metrics,
            )
        except (AdapterMismatchError, ExportError) as e:
            if strict_delta:
                raise
            log.warning("adapter delta v%04d not published: %s", v, e)
        else:
            delta = info.path
            log.info(
                "published adapter delta v%04d (%d bytes, merged sha256 %s…)",
                v,
                info.bytes,
                info.merged_sha256[:12],
            )
    return Published(v, out, manifest, weights_sha256(manifest), delta)
