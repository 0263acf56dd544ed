"""What a published-draft format is: :class:`DraftFormat`, the interface :func:`publish.write_draft`,
:func:`publish.load_draft`, :func:`compat.check_compatible` and :func:`tap_spec.read_tap_spec` use, and
:class:`HeadFormat`, the one way a format module declares itself (its head class and its own functions).

Each format module ends with its ``FORMAT`` (``eagle3_format``, ``mtp_format``, ``native_mtp_format``);
``publish/registry.py`` lists them by head kind and by manifest format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from draft_align.conventions import HeadKind
from draft_align.heads.draft_head import DraftConfigError, DraftHead
from draft_align.heads.lora import is_lora, merged
from draft_align.publish.folder import ExportError, ExportRequest

#: what a Tap captures for a published draft: (HF ``hidden_states`` indices the draft reads, [draft_vocab] int64
#: target id of each draft id)
TapCapture = tuple[tuple[int, ...], torch.Tensor]


class DraftFormat(Protocol):
    """One engine format: the head kind it writes, the manifest ``format`` it writes under, and what it checks."""

    @property
    def name(self) -> str:
        """The manifest's ``format`` (``draft_align.eagle3``, ...)."""
        ...

    @property
    def kind(self) -> HeadKind:
        """The :class:`DraftHead` ``kind`` this format writes."""
        ...

    def write(self, draft: DraftHead, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
        """Validate ``draft`` (LoRA adapters merged first), then write its folder at ``out_dir`` atomically;
        returns the manifest as written."""
        ...

    def engine_tensors(self, draft: DraftHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Exactly the tensors model.safetensors holds for the plain ``draft`` (the HF dialect)."""
        ...

    def weights_data_bytes(self, path: Path, manifest: Mapping[str, Any]) -> int:
        """The tensor bytes model.safetensors holds for the head config the manifest records."""
        ...

    def load(
        self,
        path: Path,
        manifest: Mapping[str, Any],
        *,
        device: str | torch.device,
        dtype: torch.dtype,
        weights: Mapping[str, torch.Tensor] | None,
    ) -> DraftHead:
        """The head published at ``path`` (``weights``: model.safetensors' verified tensors; None: read)."""
        ...

    def check_target(self, manifest: Mapping[str, Any], target_config: Any) -> None:
        """ExportError unless the draft ``manifest`` describes fits ``target_config`` (the tokenizer aside)."""
        ...

    def tap_capture(self, path: Path, manifest: Mapping[str, Any]) -> TapCapture:
        """What a policy-side Tap captures for the folder at ``path`` (its manifest already size-checked), read
        without loading the draft: the HF ``hidden_states`` indices the draft reads, and the target id of each
        draft id (int64)."""
        ...


H = TypeVar("H", bound=nn.Module)


@dataclass(frozen=True)
class HeadFormat(Generic[H]):
    """A :class:`DraftFormat` made of a format module's functions, each typed for its own head class ``head``:
    a :class:`DraftHead` handed in is checked to be that class, LoRA adapters merged, before the module sees it."""

    name: str
    kind: HeadKind
    head: type[H]
    write_head: Callable[[H, Path, ExportRequest], dict[str, Any]]
    head_tensors: Callable[[H, torch.dtype], dict[str, torch.Tensor]]
    load: Callable[..., H]  # (path, manifest, *, device, dtype, weights): DraftFormat.load
    weights_data_bytes: Callable[[Path, Mapping[str, Any]], int]
    check_target: Callable[[Mapping[str, Any], Any], None]
    tap_capture: Callable[[Path, Mapping[str, Any]], TapCapture]

    def own(self, draft: object) -> H:
        """``draft`` as this format's head class; ExportError for any other object."""
        if not isinstance(draft, self.head):
            raise ExportError(
                f"the {self.name} format writes {self.head.__name__} heads, got a {type(draft).__name__}"
            )
        return draft

    def write(self, draft: DraftHead, out_dir: Path, req: ExportRequest) -> dict[str, Any]:
        head = self.own(draft)
        if is_lora(head):  # engines load plain weights
            head = self.own(merged(head))
        return self.write_head(head, Path(out_dir), req)

    def engine_tensors(self, draft: DraftHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        head = self.own(draft)
        if is_lora(head):
            raise DraftConfigError("merge the adapters first (engine tensors are plain weights)")
        return self.head_tensors(head, dtype)


# --------------------------------------------------------------------------------------- checks they share
def check_built_for(built: str, sizes: tuple[tuple[str, Any, int], ...]) -> None:
    """ExportError ``"{what} mismatch: {built} {mine}, target has {theirs}"`` for the first (what, mine, theirs)
    whose sizes differ: the size check the formats run on export and against a manifest."""
    for what, mine, theirs in sizes:
        if int(mine) != theirs:
            raise ExportError(f"{what} mismatch: {built} {mine}, target has {theirs}")


def check_positions(draft_max: Any, target_config: Any, why: str = "") -> None:
    """ExportError unless the draft's ``max_position_embeddings`` reaches the target's (``why``: appended)."""
    target_max = int(target_config.max_position_embeddings)
    if int(draft_max) < target_max:
        raise ExportError(
            f"max_position_embeddings {draft_max} is smaller than the target's {target_max}{why}"
        )


def refuse_dialect(req: ExportRequest, written: str) -> None:
    """ExportError for an EAGLE-3 config dialect other than ``hf`` asked of a format that has none (``written``:
    how it writes instead)."""
    if req.dialect != "hf":
        raise ExportError(f"dialect {req.dialect!r} is an EAGLE-3 dialect: {written}")
