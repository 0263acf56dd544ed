"""A published folder: files written into a temp folder, fsynced, renamed into place; a manifest that
lists each file's sha256 and size, read back and verified (docs/formats.md §4).

A folder is written under a ``.tmp-*`` name beside its final place, fsynced, then renamed: a reader sees
either no folder or a complete one.  :func:`read_manifest` re-hashes every file the manifest lists.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import safetensors.torch
import torch

import draft_align
from draft_align.conventions import FLOAT_DTYPE_NAMES, dtype_name, float_dtype
from draft_align.storage import make_shared_dirs, save_tensors, share_tree

EAGLE3_FORMAT = "draft_align.eagle3"  # written by publish/eagle3_format.py
MTP_FORMAT = "draft_align.mtp"  # written by publish/mtp_format.py
NATIVE_MTP_FORMAT = "draft_align.native_mtp"  # written by publish/native_mtp_format.py
DRAFT_FORMATS = (EAGLE3_FORMAT, MTP_FORMAT, NATIVE_MTP_FORMAT)
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"

C = TypeVar("C")

#: Manifest keys every draft format writes; ``extra_manifest`` may not shadow them.
RESERVED_KEYS = frozenset(
    {
        "format",
        "format_version",
        "dialect",
        "architecture",
        "files",
        "draft_version",
        "policy_version",
        "target",
        "aux_layer_ids",
        "draft_vocab_size",
        "tokenizer_fingerprint",
        "created",
        "draft_align_version",
        "dtype",
        "metrics",
        "eagle3_config",
    }
)


class ExportError(ValueError):
    """A draft that must not be published, or a checkpoint that does not fit the given target."""


class CorruptCheckpointError(ExportError):
    """A checkpoint folder whose files do not match its manifest (or that has no readable manifest)."""


Dialect = Literal["hf", "speculators"]  # the EAGLE-3 config.json dialects (eagle3_format.DIALECTS)


@dataclass(frozen=True)
class ExportRequest:
    """What every draft format records besides the head itself: provenance, the target, the storage dtype,
    the EAGLE-3 config dialect.

    ``target_config``: the target's HF config (num_hidden_layers, hidden_size, vocab_size,
    max_position_embeddings, RoPE fields).  ``extra_manifest`` keys are merged into the manifest's top level
    (they may not shadow its own keys).  ``dialect`` (EAGLE-3 only; an MTP head has its own layout and takes
    ``hf`` only): ``hf`` (vLLM / SGLang config.json) or ``speculators``, whose default proposal length is
    ``speculative_tokens``.
    """

    target_config: Any
    target_name: str
    metrics: dict[str, Any]
    draft_version: int
    policy_version: int
    tokenizer_fingerprint: str
    dtype: torch.dtype = torch.bfloat16
    extra_manifest: dict[str, Any] | None = None
    overwrite: bool = False
    dialect: Dialect = "hf"
    speculative_tokens: int = 3


def float_dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a storage dtype (bfloat16, float16 or float32); ExportError for any other."""
    try:
        name = dtype_name(dtype)
    except ValueError:
        name = ""
    if name not in FLOAT_DTYPE_NAMES:
        raise ExportError(f"dtype {dtype} not supported: use one of {list(FLOAT_DTYPE_NAMES)}")
    return name


def check_finite(name: str, t: torch.Tensor, cast_to: torch.dtype | None = None) -> None:
    """ExportError when the floating tensor ``t`` holds NaN or Inf (``cast_to``: the storage dtype it was just cast
    to, e.g. weights finite in float32 and ±inf in bfloat16)."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        after = f" after casting to {cast_to}" if cast_to is not None else ""
        raise ExportError(f"non-finite values (NaN/Inf) in {name}{after}")


# --------------------------------------------------------------------------------------- bytes on disk
def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list, after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def digest(path: Path) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, streamed."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and callable(obj.item):  # torch / numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=_json_default) + "\n"


def _rename_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` folder to ``out_dir``; with ``overwrite``, swap out the old one."""
    parent = out_dir.parent
    if not os.path.lexists(out_dir):
        os.replace(tmp, out_dir)
        fsync_path(parent)
        return
    if not overwrite:
        raise ExportError(f"{out_dir} already exists; pass overwrite=True to replace it")
    # No atomic directory exchange in the stdlib: rename the old one away first.  A crash between the two
    # renames leaves no out_dir (and a complete ``.old-*`` folder), never a half-written one.
    old = parent / f".old-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    fsync_path(parent)
    shutil.rmtree(old, ignore_errors=True)


def check_destination(
    out_dir: Path, overwrite: bool, extra_manifest: dict[str, Any] | None, reserved: frozenset[str] | set[str]
) -> None:
    """Refuse an ``out_dir`` that exists (unless ``overwrite`` and it is a real folder) and
    ``extra_manifest`` keys that would shadow the manifest's own ``reserved`` keys."""
    if os.path.lexists(out_dir):
        if not overwrite:
            raise ExportError(f"{out_dir} already exists; pass overwrite=True to replace it")
        if not out_dir.is_dir() or out_dir.is_symlink():
            raise ExportError(f"{out_dir} exists and is not a checkpoint folder; refusing to replace it")
    clash = sorted(set(extra_manifest or {}) & set(reserved))
    if clash:
        raise ExportError(f"extra_manifest keys {clash} would shadow manifest fields")


def publish_folder(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    *,
    weights_file: str = WEIGHTS_FILE,
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write ``config`` (config.json, when given), ``tensors`` (``weights_file``) and ``manifest``
    (manifest.json, with each file's sha256 and size under ``files``) into a temp folder beside ``out_dir``,
    fsync'd, then rename it into place: ``out_dir`` appears complete or not at all."""
    try:
        config_text = None if config is None else _dumps(config)
        _dumps(manifest)  # fail on unserialisable metrics before touching the disk
    except (TypeError, ValueError) as e:
        raise ExportError(f"manifest/config not JSON serialisable: {e}") from e
    parent = out_dir.parent
    make_shared_dirs(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=parent))
    try:
        names = [weights_file]
        if config_text is not None:
            _write_text(tmp / CONFIG_FILE, config_text)
            names.insert(0, CONFIG_FILE)
        save_tensors(tensors, tmp / weights_file, metadata={"format": "pt"})
        fsync_path(tmp / weights_file)
        for name in names:
            sha, size = digest(tmp / name)
            manifest["files"][name] = {"sha256": sha, "bytes": size}
        _write_text(tmp / MANIFEST_FILE, _dumps(manifest))
        share_tree(tmp)  # engines may run as another user, in the run folder's group (storage.py)
        fsync_path(tmp)
        _rename_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------- manifest
def draft_manifest(
    identity: dict[str, Any],
    req: ExportRequest,
    *,
    architecture: str,
    aux_layer_ids: dict[str, Any],
    draft_vocab_size: int,
    head_config: dict[str, Any],
) -> dict[str, Any]:
    """A published draft's manifest: ``identity`` (format, format_version and the dialect or layout) first,
    then provenance and the target's shape, ``head_config`` (``{"eagle3_config": …}`` or
    ``{"mtp_config": …}``) and ``req.extra_manifest`` last; ``files`` is filled in by :func:`publish_folder`."""
    tc = req.target_config
    return {
        **identity,
        "architecture": architecture,
        "files": {},
        "draft_version": int(req.draft_version),
        "policy_version": int(req.policy_version),
        "target": {
            "name": req.target_name,
            "num_hidden_layers": int(tc.num_hidden_layers),
            "hidden_size": int(tc.hidden_size),
            "vocab_size": int(tc.vocab_size),
            "max_position_embeddings": int(tc.max_position_embeddings),
        },
        "aux_layer_ids": aux_layer_ids,
        "draft_vocab_size": draft_vocab_size,
        "tokenizer_fingerprint": req.tokenizer_fingerprint,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "draft_align_version": draft_align.__version__,
        "dtype": float_dtype_name(req.dtype),
        "metrics": req.metrics,
        **head_config,
        **(req.extra_manifest or {}),
    }


def final_hidden_aux(aux_layer_ids: Sequence[int]) -> dict[str, Any]:
    """The manifest's ``aux_layer_ids`` of an MTP head (either kind): the final post-norm hidden state."""
    return {"hf": list(aux_layer_ids), "note": "MTP reads the final post-norm hidden (HF index L)"}


# --------------------------------------------------------------------------------------- reading back
MAX_MANIFEST_BYTES = 16 << 20  # manifest.json is read whole
MAX_SIDE_FILE_BYTES = 1 << 20  # config.json, or any listed file but the weights
SAFETENSORS_HEADER_SLACK = 1 << 20  # a safetensors file: u64 header length, JSON header (a few KiB), data


def plain_file(folder: Path, name: str) -> os.stat_result:
    """``folder/name``'s stat: a regular file, and no symbolic link leading out of ``folder`` (a link inside it
    is followed).  CorruptCheckpointError (FileNotFoundError when it is missing) otherwise."""
    folder = Path(folder)
    if Path(name).name != name or name in ("", ".", ".."):
        raise CorruptCheckpointError(f"{folder / MANIFEST_FILE}: file name {name!r} is not a plain name")
    path = folder / name
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        real = path.resolve()
        try:
            real.relative_to(folder.resolve())
        except ValueError:
            raise CorruptCheckpointError(
                f"{path} is a link to {real}, outside {folder}: refused (copy the file into the folder)"
            ) from None
        st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"{path} is not a regular file")
    return st


def check_sizes(folder: Path, manifest: Mapping[str, Any], data_bytes: int) -> None:
    """Before any file is hashed: each listed file's size, as the manifest records it and on disk, must be what
    the head config implies: the weights ``data_bytes`` of tensor data plus a safetensors header (at most
    SAFETENSORS_HEADER_SLACK), any other file at most MAX_SIDE_FILE_BYTES.  CorruptCheckpointError otherwise."""
    mpath = Path(folder) / MANIFEST_FILE
    for name, info in dict(manifest["files"]).items():
        low, high = (
            (data_bytes + 8, data_bytes + 8 + SAFETENSORS_HEADER_SLACK)
            if name == WEIGHTS_FILE
            else (0, MAX_SIDE_FILE_BYTES)
        )
        said = info.get("bytes") if isinstance(info, dict) else None
        if isinstance(said, bool) or not isinstance(said, int) or not low <= said <= high:
            raise CorruptCheckpointError(
                f"{mpath}: {name} listed at {said!r} bytes, the head config implies {low}..{high}: refused"
            )
        try:
            size = plain_file(folder, name).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{name} is listed in the manifest but missing from {folder}"
            ) from None
        if size != said:
            raise CorruptCheckpointError(
                f"{name}: {size} bytes, manifest says {said} (truncated or modified)"
            )


def verify_file(folder: Path, name: str, info: Any) -> None:
    """Raise CorruptCheckpointError unless ``folder/name`` (a regular file, no link out of ``folder``) has the
    manifest entry's size, checked before it is hashed, and sha256."""
    folder = Path(folder)
    try:
        size = plain_file(folder, name).st_size
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{name} is listed in the manifest but missing from {folder}") from None
    said = info.get("bytes") if isinstance(info, dict) else None
    if size != said:
        raise CorruptCheckpointError(f"{name}: {size} bytes, manifest says {said} (truncated or modified)")
    sha, size = digest(folder / name)
    if size != said:
        raise CorruptCheckpointError(f"{name}: changed while it was read (truncated or modified)")
    if sha != info.get("sha256"):
        raise CorruptCheckpointError(f"{name}: sha256 mismatch with the manifest (corrupt or modified)")


def verify_files(folder: Path, manifest: Mapping[str, Any]) -> None:
    """:func:`verify_file` on every file the manifest lists."""
    for name, info in dict(manifest["files"]).items():
        verify_file(folder, name, info)


def read_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``; with ``verify``, every listed file's size and sha256.

    Raises CorruptCheckpointError when the manifest is missing or unparsable, or a file is missing,
    truncated or modified.
    """
    path = Path(path)
    mpath = path / MANIFEST_FILE
    try:
        if plain_file(path, MANIFEST_FILE).st_size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{mpath}: larger than {MAX_MANIFEST_BYTES >> 20} MiB: refused")
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CorruptCheckpointError(
            f"{mpath} is missing: half-written or not a draft_align checkpoint"
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{mpath} is unparsable ({e}): half-written or not a draft_align checkpoint"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") not in DRAFT_FORMATS:
        raise CorruptCheckpointError(f"{mpath}: not a draft_align checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{mpath}: format_version {manifest.get('format_version')} unsupported")
    files = manifest.get("files")
    if not isinstance(files, dict) or not {CONFIG_FILE, WEIGHTS_FILE} <= set(files):
        raise CorruptCheckpointError(f"{mpath}: files must list {CONFIG_FILE} and {WEIGHTS_FILE}")
    if verify:
        verify_files(path, manifest)
    return manifest


def read_head_config(
    path: Path, manifest: Mapping[str, Any], key: str, from_dict: Callable[[dict[str, Any]], C]
) -> C:
    """The head config a format stores under ``manifest[key]`` (``eagle3_config``, ``mtp_config``), parsed by
    ``from_dict``; ExportError naming the manifest when it is missing, not a mapping, or refused by
    ``from_dict`` (a DraftConfigError is a ValueError)."""
    try:
        return from_dict(dict(manifest[key]))
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{Path(path) / MANIFEST_FILE}: {key} unusable: {e}") from e


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The folder's model.safetensors, loaded on the CPU; CorruptCheckpointError when it cannot be read."""
    try:
        plain_file(Path(path), WEIGHTS_FILE)  # no link out of the folder
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{WEIGHTS_FILE} is missing from {path}") from None
    try:
        return safetensors.torch.load_file(str(Path(path) / WEIGHTS_FILE), device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated headers / data
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: unreadable ({e}); truncated or corrupt") from e


def stored_itemsize(path: Path, manifest: Mapping[str, Any]) -> int:
    """Bytes per element of the manifest's float storage ``dtype``; ExportError for another dtype."""
    try:
        return float_dtype(str(manifest.get("dtype"))).itemsize
    except ValueError as e:
        raise ExportError(f"{Path(path) / MANIFEST_FILE}: {e}") from e


def read_verified_weights(path: Path, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The folder's model.safetensors parsed from one read of its bytes, after those bytes matched the
    manifest's size and sha256 (so the tensors are exactly what was verified); CorruptCheckpointError if not."""
    info = manifest["files"][WEIGHTS_FILE]
    try:
        data = (Path(path) / WEIGHTS_FILE).read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: unreadable in {path} ({e})") from e
    if len(data) != info.get("bytes"):
        raise CorruptCheckpointError(
            f"{WEIGHTS_FILE}: {len(data)} bytes, manifest says {info.get('bytes')} (truncated or modified)"
        )
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise CorruptCheckpointError(
            f"{WEIGHTS_FILE}: sha256 mismatch with the manifest (corrupt or modified)"
        )
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CorruptCheckpointError(f"{WEIGHTS_FILE}: unreadable ({e}); corrupt") from e


def weights_sha256(manifest: dict[str, Any]) -> str:
    """The sha256 the manifest records for the folder's model.safetensors."""
    return str(manifest["files"][WEIGHTS_FILE]["sha256"])
