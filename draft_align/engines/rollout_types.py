"""What the RL job and a rollout engine exchange, engine-neutral (no vLLM, nothing of the RL loop).

- :class:`DraftVersion`: a published draft folder whose sha256 was verified once, handed to whoever serves it
  (the reference decoder, an engine's refresher);
- :class:`RolloutPlan`: which prompt each rollout of a step decodes, with which draft, and where its seed
  comes from;
- :class:`Decoding`: how every rollout of a step is decoded (temperature, length limit, stop tokens);
- :class:`Rollout`: one decoded response and what the job adds to it (reward, advantage).

The RL job's interface to an engine is :class:`draft_align.rl.rollouts.RolloutEngine`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draft_align.acceptance import AcceptanceTally
from draft_align.conventions import DraftKind
from draft_align.publish import checked_manifest
from draft_align.publish.folder import WEIGHTS_FILE
from draft_align.publish.versions import resolve_draft_dir


@dataclass(frozen=True)
class DraftVersion:
    """A published draft folder, its manifest and the sha256 of its weights, as verified (docs/formats.md).

    ``weights``: the tensors parsed from exactly the bytes that hashed to ``sha256``, when the verifier kept
    them; an engine loads those instead of reading (and hashing) the file again.  Not part of equality.
    """

    path: Path
    manifest: Mapping[str, Any]
    sha256: str  # of model.safetensors
    weights: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, path: Path, manifest: Mapping[str, Any], weights: Mapping[str, torch.Tensor] | None = None
    ) -> DraftVersion:
        """The version at ``path`` whose files were verified against ``manifest`` by the caller (``weights``:
        the tensors of exactly the bytes it verified, if it kept them)."""
        return cls(Path(path), manifest, str(manifest["files"][WEIGHTS_FILE]["sha256"]), weights)

    def without_weights(self) -> DraftVersion:
        """The same version with no kept tensors (an engine then reads and hashes the file itself)."""
        return DraftVersion(self.path, self.manifest, self.sha256)

    @classmethod
    def read(cls, path: str | Path) -> DraftVersion:
        """Verify the folder (or a run folder's ``latest``) against its manifest: every file's size and sha256."""
        folder = resolve_draft_dir(Path(path))
        return cls.of(folder, checked_manifest(folder, verify=True))

    @property
    def version(self) -> int:
        return int(self.manifest["draft_version"])

    @property
    def policy_version(self) -> int:
        """The policy version the draft was trained for."""
        return int(self.manifest["policy_version"])


@dataclass(frozen=True)
class PlannedRollout:
    index: int  # position in the step's rollouts (group-major)
    prompt_index: int
    draft: DraftKind


@dataclass(frozen=True)
class RolloutPlan:
    """One step's rollouts.  ``rng_state``: the step's RNG after the draws that made the plan; an engine
    draws one seed per rollout from it, in rollout order, of the width its sampler takes (:meth:`seeds`)."""

    rollouts: tuple[PlannedRollout, ...]
    rng_state: tuple[Any, ...]

    def seeds(self, bits: int) -> list[int]:
        """One ``bits``-bit seed per rollout, in order (the same list on every call)."""
        rng = random.Random()
        rng.setstate(self.rng_state)
        return [rng.getrandbits(bits) for _ in self.rollouts]


@dataclass(frozen=True)
class Decoding:
    """How every rollout of a step is decoded: sampling ``temperature`` (the policy's; 0 is greedy), at most
    ``max_tokens`` new tokens, a response ends after any token of ``eos_ids``."""

    temperature: float
    max_tokens: int
    eos_ids: frozenset[int]


@dataclass
class Rollout:
    """One decoded response of a step."""

    prompt_index: int
    prompt: torch.Tensor  # [P]
    response: torch.Tensor  # [R] new tokens (eos included when finished)
    finished: bool  # ended with an eos token
    draft: DraftKind
    tally: AcceptanceTally | None  # per-rollout tally of the reference decoder (None: an engine's rollout)
    reward: float = 0.0
    engine_logprobs: torch.Tensor | None = None  # [R] the engine's log-probs of the sampled tokens
    advantage: float = 0.0
