"""The publish decision and the versioned publish.

Every ``sidecar.publish.every_s`` (after ``publish.min_train_steps`` steps) the candidate is compared with the
published draft on the freshest held-out records (paired, per sequence, round-walk estimate,
:func:`paired_gate`); it is published only if not worse beyond noise: ``diff ≥ −max(gate.tolerance,
2·stderr)``.  A published version is a complete folder renamed into place (never half-visible), then
``latest`` moves, ``DraftPublished`` is sent and ``publish.jsonl`` gets a line (docs/formats.md).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_align.config.sections import SidecarConfig
from draft_align.heads.draft_head import DraftHead
from draft_align.monitor.tapped_estimate import RecordEstimateError
from draft_align.publish.folder import ExportError
from draft_align.publish.versions import prune_versions, publish_version
from draft_align.sidecar.layout import PUBLISH_FILE, SIDECAR_DIR
from draft_align.sidecar.state import SidecarState
from draft_align.train.records import TappedRecord
from draft_align.wire.channel import Publisher

log = logging.getLogger(__name__)

#: (draft, records, verify mode, temperature) → an ``estimate_records`` result
Estimate = Callable[[nn.Module, list[TappedRecord], str, float], dict[str, Any]]


def paired_gate(cand: dict[str, Any], base: dict[str, Any], tolerance: float) -> tuple[bool, float, float]:
    """Paired comparison of two :func:`~draft_align.monitor.tapped_estimate.estimate_records` results on the same
    records: (ok, diff, stderr); RecordEstimateError when they are not on the same records.

    d_i = L_cand,i − L_base,i (per-sequence round-walk mean lengths), weights w_i = (R_cand,i + R_base,i) / 2
    (mean rounds, so swapping the drafts flips the sign); sequences with no round in either are skipped.
    diff = Σ w̃_i d_i with w̃ = w / Σ w; stderr² = n/(n−1) · Σ w̃_i² (d_i − diff)² (NaN for n = 1, then
    the tolerance alone decides).  ok iff diff ≥ −max(tolerance, 2·stderr).
    """
    if tolerance < 0:
        raise RecordEstimateError(f"tolerance must be ≥ 0, got {tolerance}")
    a, b = cand["per_sequence"], base["per_sequence"]
    if len(a) != len(b):
        raise RecordEstimateError(f"per_sequence lengths differ ({len(a)} vs {len(b)}): not the same records")
    ids_a, ids_b = cand.get("sequence_ids"), base.get("sequence_ids")
    if ids_a is not None and ids_b is not None and list(ids_a) != list(ids_b):
        raise RecordEstimateError("sequence_ids differ: the two estimates are not on the same records")
    pairs = [(la - lb, 0.5 * (ra + rb)) for (la, ra), (lb, rb) in zip(a, b, strict=True) if ra > 0 and rb > 0]
    if not pairs:
        raise RecordEstimateError("no sequence with a drafting round in both estimates")
    d = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    w = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    w = w / w.sum()
    diff = float((w * d).sum())
    n = d.numel()
    stderr = math.sqrt(float((w.square() * (d - diff).square()).sum()) * n / (n - 1)) if n > 1 else math.nan
    bar = tolerance if math.isnan(stderr) else max(tolerance, 2.0 * stderr)
    return diff >= -bar, diff, stderr


def plain_copy(draft: DraftHead, device: torch.device) -> DraftHead:
    """A plain copy (EAGLE-3 or MTP; LoRA adapters merged) on ``device``."""
    from draft_align.heads.lora import is_lora, merged

    if is_lora(draft):
        draft = merged(draft)
    out = type(draft)(draft.cfg).to(device)
    out.load_state_dict(draft.state_dict())
    return out


class Gate:
    """The published draft the candidate must beat, and publishing a candidate that does.

    ``target_config``/``target_name``/``tokenizer_fingerprint``/``frozen_manifest``: what every published
    manifest records; ``publisher``: the ``DraftPublished`` PUB socket (None on ranks that never publish).
    """

    def __init__(
        self,
        sidecar: SidecarConfig,
        state: SidecarState,
        published: DraftHead,
        *,
        run_dir: Path,
        run_id: str,
        device: torch.device,
        target_config: Any,
        target_name: str,
        tokenizer_fingerprint: str | None,
        frozen_manifest: dict[str, Any],
        publisher: Publisher | None,
        protect: tuple[Path, ...] = (),
    ) -> None:
        self.sidecar = sidecar  # the recipe's sidecar section: publish, gate, train
        self.run_id = run_id
        self.state = state
        self.published = published
        self.device = device
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / SIDECAR_DIR
        self.target_config = target_config
        self.target_name = target_name
        self.tok_fp = tokenizer_fingerprint
        self.frozen_manifest = frozen_manifest
        self.publisher = publisher
        self.protect = tuple(Path(p) for p in protect)  # folders retention never deletes (the starting draft)
        self.last_publish = time.monotonic()
        self.steps_since_publish = 0
        self.tried_version = -1  # the trained policy version of the last attempt (publish.on_new_version)
        self.last_gain: float | None = None  # the last published candidate − the draft it replaced (paired)

    def due(self, force: bool = False) -> bool:
        """Enough train steps since the last publish, and the interval passed (or ``force``, or with
        ``publish.on_new_version`` the candidate trained on a policy version newer than the published draft's
        and no attempt was made for that version yet)."""
        sc = self.sidecar.publish
        if self.steps_since_publish < sc.min_train_steps:
            return False
        trained = self.state.trained_policy_version
        if sc.on_new_version and trained > max(self.state.published_policy_version, self.tried_version):
            return True
        return force or time.monotonic() - self.last_publish >= sc.every_s

    def maybe_publish(
        self, candidate: Callable[[], nn.Module], holdout: list[TappedRecord], estimate: Estimate
    ) -> bool:
        """Gate ``candidate()`` against the published draft on ``holdout`` and publish it if it passes; True when
        a new version was published (call only when :meth:`due`)."""
        gc = self.sidecar.gate
        self.last_publish = time.monotonic()
        self.tried_version = self.state.trained_policy_version
        if not holdout:
            return False
        cand = candidate()
        if not all(torch.isfinite(p).all() for p in cand.parameters()):
            self.state.gate_rejections += 1
            log.error("candidate draft has non-finite weights: not published")
            return False
        c = estimate(cand, holdout, gc.mode, gc.temperature)
        b = estimate(self.published, holdout, gc.mode, gc.temperature)
        ok, diff, stderr = paired_gate(c, b, gc.tolerance)
        if not ok:
            self.state.gate_rejections += 1
            log.info(
                "gate: candidate %.4f vs published %.4f (diff %.4f ± %.4f): not published",
                c["acceptance_length_est"],
                b["acceptance_length_est"],
                diff,
                stderr,
            )
            return False
        # the newest policy version the candidate trained on (older sidecar states: the gate set's newest)
        trained = self.state.trained_policy_version
        policy_version = trained if trained >= 0 else max(tr.policy_version for tr in holdout)
        # retention before the publish: with the new version there are at most keep_versions, even when the
        # process is killed right after the rename (pruning afterwards would leave keep_versions + 1)
        self._prune(self.sidecar.publish.keep_versions - 1)
        try:
            self._publish(cand, c, b, diff, stderr, policy_version)
        except ExportError as e:
            self.state.gate_rejections += 1
            log.error("candidate not published: %s", e)
            return False
        self.last_gain = diff
        return True

    def _prune(self, keep: int) -> None:
        """Retention (the module docstring) down to ``keep`` versions; a failure to delete is logged, never fatal."""
        lora_base = (Path(self.state.lora_base_dir),) if self.state.lora_base_dir else ()
        try:
            prune_versions(self.run_dir, keep, protect=self.protect + lora_base)
        except OSError as e:
            log.error("retention: %s", e)

    def _publish(
        self, cand_draft: nn.Module, cand: dict, base: dict, diff: float, stderr: float, policy_version: int
    ) -> None:
        from draft_align.wire.messages import DraftPublished

        metrics = {
            "gate_candidate": cand["acceptance_length_est"],
            "gate_published": base["acceptance_length_est"],
            "gate_diff": diff,
            "gate_stderr": stderr,
            "train_steps": self.state.train_steps,
            "trained_tokens": self.state.trained_tokens,
        }
        sc = self.sidecar.train
        delta_base = (
            Path(self.state.lora_base_dir or "") if sc.adapt == "lora" and sc.lora.publish_delta else None
        )
        pub = publish_version(
            self.run_dir,
            cand_draft,
            target_config=self.target_config,
            target_name=self.target_name,
            tokenizer_fingerprint=self.tok_fp,
            metrics=metrics,
            policy_version=policy_version,
            extra_manifest={
                "trained_from": str(self.frozen_manifest.get("draft_version", 0)),
                "run": self.run_id,
            },
            at_least=self.state.published_version + 1,
            delta_base=delta_base,
            strict_delta=False,
        )
        v = pub.version
        self.published = plain_copy(cand_draft, self.device)
        self.published.eval()
        self.state.published_version = v
        self.state.published_policy_version = policy_version
        self.steps_since_publish = 0
        assert self.publisher is not None, "only the lead rank publishes"
        self.publisher.publish(
            DraftPublished(
                run_id=self.run_id,
                draft_version=v,
                policy_version=policy_version,
                path=str(pub.path),
                sha256=pub.weights_sha256,
                # the wire carries finite numbers only (a 1-record gate set has no stderr: NaN stays in publish.jsonl)
                metrics={k: float(x) for k, x in metrics.items() if math.isfinite(float(x))},
            )
        )
        with open(self.dir / PUBLISH_FILE, "a", encoding="utf-8") as f:
            f.write(
                json.dumps(
                    {
                        "time": time.time(),
                        "draft_version": v,
                        "policy_version": policy_version,
                        "sha256": pub.weights_sha256,
                        **metrics,
                    }
                )
                + "\n"
            )
        log.info(
            "published draft v%04d (policy v%d): gate %.4f vs %.4f",
            v,
            policy_version,
            cand["acceptance_length_est"],
            base["acceptance_length_est"],
        )
