"""The RL policy: an HF causal LM with a peft LoRA adapter, versioned, savable and measurable.

``Policy.hf_model`` is the LoRA-injected HF model (``peft_model.base_model.model``): the Tap hooks it and
the SpecDecoder runs it as the target, so both see the current policy.  Only LoRA parameters train; the B
matrices start at zero, so version 0 computes exactly the base model.  Version 0 is the initial policy and
every optimizer update adds one.

Drift is measured as the mean over response tokens of KL(π_current ‖ π_initial) on fixed teacher-forced
sequences, exactly over the full vocabulary::

    KL_t = Σ_x p_t(x) (log p_t(x) − log p0_t(x))        p = current policy, p0 = adapter disabled
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from draft_align.storage import make_shared_dirs, share_tree

if TYPE_CHECKING:
    from draft_align.config.sections import PolicyLoraConfig

log = logging.getLogger(__name__)

POLICY_DIR = "policy"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
VERSION_FILE = "policy_version.json"


class PolicyError(ValueError):
    """A policy adapter or sequence batch that cannot be used as asked."""


def adapter_dir(run_dir: Path, version: int) -> Path:
    """``run_dir/policy/v{version:04d}``: where the adapter of policy ``version`` is saved."""
    return Path(run_dir) / POLICY_DIR / f"v{int(version):04d}"


# --------------------------------------------------------------------------------------- sequences
@dataclass
class Sequences:
    """Right-padded prompt ⧺ response sequences.

    ``loss_mask`` marks response tokens; every row has a prompt of ≥ 1 token, so each response token t
    has a predicting position t − 1.
    """

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens (a prefix of each row)
    loss_mask: torch.Tensor  # [B, T] bool, response tokens

    def __post_init__(self) -> None:
        shapes = {tuple(self.input_ids.shape), tuple(self.attention_mask.shape), tuple(self.loss_mask.shape)}
        if self.input_ids.dim() != 2 or len(shapes) != 1:
            raise PolicyError(
                f"input_ids {tuple(self.input_ids.shape)}, attention_mask {tuple(self.attention_mask.shape)} "
                f"and loss_mask {tuple(self.loss_mask.shape)} must be equal [B, T] shapes"
            )
        if self.loss_mask.dtype != torch.bool:
            raise PolicyError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        if self.input_ids.shape[1] and bool(self.loss_mask[:, 0].any()):
            raise PolicyError("a response token at position 0 has no predicting position (empty prompt)")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @classmethod
    def pack(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> Sequences:
        """Right-pad ``(prompt [P], response [R])`` pairs (P, R ≥ 1) into one batch."""
        if not pairs:
            raise PolicyError("no sequences to pack")
        rows = [(p.flatten().long().cpu(), r.flatten().long().cpu()) for p, r in pairs]
        for i, (p, r) in enumerate(rows):
            if p.numel() < 1 or r.numel() < 1:
                raise PolicyError(
                    f"sequence {i}: prompt ({p.numel()}) and response ({r.numel()}) must be non-empty"
                )
        width = max(p.numel() + r.numel() for p, r in rows)
        ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
        attn = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (p, r) in enumerate(rows):
            n = p.numel() + r.numel()
            ids[i, :n] = torch.cat([p, r])
            attn[i, :n] = 1
            mask[i, p.numel() : n] = True
        return cls(ids, attn, mask)

    def select(self, rows: Sequence[int]) -> Sequences:
        """The given rows, cropped to their longest one."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        attn = self.attention_mask[idx]
        width = int(attn.sum(-1).max()) if idx.numel() else 0
        return Sequences(self.input_ids[idx, :width], attn[:, :width], self.loss_mask[idx, :width])

    def micro_batches(self, size: int) -> Iterator[Sequences]:
        """Consecutive chunks of ``size`` rows, each cropped to its longest row."""
        if size < 1:
            raise PolicyError(f"micro-batch size must be ≥ 1, got {size}")
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def to(self, device: torch.device | str) -> Sequences:
        return Sequences(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))


def response_window(loss_mask: torch.Tensor) -> tuple[int, int]:
    """(lo, hi): logits at positions lo..hi−1 predict every response token of the batch (loss_mask [B, T])."""
    cols = loss_mask.any(0).nonzero().flatten()
    if cols.numel() == 0:
        raise PolicyError("batch has no response token")
    return int(cols[0]) - 1, int(cols[-1])


def gather_response(logits: torch.Tensor, batch: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-sequence logits [B, T, V] → (logits predicting each response token [N, V], the tokens [N]).

    N = ``batch.num_response_tokens``, in row-major (row, position) order.
    """
    select = batch.loss_mask[:, 1:].to(logits.device)
    return logits[:, :-1][select], batch.input_ids[:, 1:].to(logits.device)[select]


# --------------------------------------------------------------------------------------- files
@contextlib.contextmanager
def _atomic_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success rename it into place (swap with ``overwrite``)."""
    out_dir = Path(out_dir)
    if os.path.lexists(out_dir) and not overwrite:
        raise PolicyError(f"{out_dir} already exists; pass overwrite=True to replace it")
    make_shared_dirs(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        yield tmp
        share_tree(tmp)  # an engine may load it as another user, in the run folder's group (storage.py)
        if os.path.lexists(out_dir):
            old = out_dir.parent / f".old-{out_dir.name}-{uuid.uuid4().hex[:8]}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _source_dir(model: nn.Module) -> Path | None:
    """The local checkpoint folder ``model`` was loaded from (None: built from a config or a hub id)."""
    src = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return Path(src) if src and Path(src).is_dir() else None


def _carry_unloaded(src: Path | None, out: Path, held: set[str]) -> list[str]:
    """Copy into the saved folder ``out`` the tensors of the source checkpoint ``src`` that the HF model does not
    hold (``held``: its state-dict names), and keep the source's ``architectures``.

    transformers drops a checkpoint's multi-token-prediction layers when it loads the trunk (MiMo's
    ``model.mtp_layers.*``, GLM-4.5's and DeepSeek-V3's layers past ``num_hidden_layers``): without this a merged
    policy would lose its own MTP layers and its architecture name (``MiMoForCausalLM`` saved as
    ``Qwen2ForCausalLM``), and an engine could no longer serve it with its MTP drafter.  They are not trained by
    the policy's LoRA, so the source's values are the merged policy's.  Returns the names carried."""
    if src is None:
        return []
    import safetensors.torch
    from safetensors import safe_open

    extra: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                if k not in held and not k.endswith("rotary_emb.inv_freq"):
                    extra[k] = fh.get_tensor(k)
    if not extra:
        return []
    index = out / "model.safetensors.index.json"
    if index.exists():
        shard = "model-carried.safetensors"
        safetensors.torch.save_file(extra, str(out / shard), metadata={"format": "pt"})
        idx = json.loads(index.read_text(encoding="utf-8"))
        idx.setdefault("weight_map", {}).update(dict.fromkeys(extra, shard))
        index.write_text(json.dumps(idx, indent=2) + "\n", encoding="utf-8")
    else:
        single = out / "model.safetensors"
        tensors = safetensors.torch.load_file(str(single))
        tensors.update(extra)
        safetensors.torch.save_file(tensors, str(single), metadata={"format": "pt"})
    src_cfg, out_cfg = src / "config.json", out / "config.json"
    if src_cfg.exists() and out_cfg.exists():
        arch = json.loads(src_cfg.read_text(encoding="utf-8")).get("architectures")
        cfg = json.loads(out_cfg.read_text(encoding="utf-8"))
        if arch:
            cfg["architectures"] = arch
            out_cfg.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    log.info("merged policy: %d tensors the model does not hold carried from %s", len(extra), src)
    return sorted(extra)


# --------------------------------------------------------------------------------------- policy
class Policy:
    """An HF causal LM plus a LoRA adapter (peft); see the module docstring.

    ``model`` is modified in place (LoRA layers are injected); its base weights are frozen.  The LoRA A
    matrices are drawn from a generator seeded with ``seed`` (the global RNG is left as it was).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lora_r: int,
        lora_alpha: int,
        lora_dropout: float = 0.0,
        target_modules: Sequence[str],
        seed: int = 0,
    ) -> None:
        from peft import LoraConfig, get_peft_model

        if lora_r < 1:
            raise PolicyError(f"lora_r must be ≥ 1, got {lora_r}")
        if not target_modules:
            raise PolicyError("target_modules is empty: LoRA would train nothing")
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = sorted(set(target_modules) - names)
        if missing:
            raise PolicyError(f"LoRA target modules {missing} are not in {type(model).__name__}")
        self.lora_config = LoraConfig(
            r=int(lora_r),
            lora_alpha=int(lora_alpha),
            lora_dropout=float(lora_dropout),
            target_modules=list(target_modules),
            bias="none",
            init_lora_weights=True,  # A ~ kaiming-uniform, B = 0: version 0 equals the base model
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.peft_model = get_peft_model(model, self.lora_config)
        self.hf_model: nn.Module = self.peft_model.base_model.model
        self.hf_model.eval()
        self.version = 0
        bad = [n for n, p in self.peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
        if bad:
            raise PolicyError(f"non-LoRA parameters would train: {bad[:5]}")

    @classmethod
    def from_config(cls, model: nn.Module, lora: PolicyLoraConfig, seed: int = 0) -> Policy:
        """A policy with the LoRA settings of ``lora`` (the recipe's ``rl.policy.lora``)."""
        return cls(
            model,
            lora_r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            seed=seed,
        )

    # ----------------------------------------------------------------- basics
    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The LoRA parameters (the only ones with ``requires_grad``)."""
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def initial(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which ``hf_model`` computes the initial policy (the adapter disabled)."""
        return self.peft_model.disable_adapter()

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T, V] of right-padded ``input_ids`` [B, T] (grad follows the caller's mode)."""
        dev = self.device
        return self.hf_model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev)).logits

    def response_logits(self, batch: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits predicting each response token [N, V], the tokens [N]); same order as :func:`gather_response`.

        Only positions lo..hi−1 of :func:`response_window` reach the lm_head (``logits_to_keep``).
        """
        dev = self.device
        lo, hi = response_window(batch.loss_mask)
        keep = torch.arange(lo, hi, device=dev)
        out = self.hf_model(
            input_ids=batch.input_ids.to(dev),
            attention_mask=batch.attention_mask.to(dev),
            logits_to_keep=keep,
        ).logits  # [B, hi − lo, V]
        select = batch.loss_mask[:, lo + 1 : hi + 1].to(dev)
        return out[select], batch.input_ids[:, lo + 1 : hi + 1].to(dev)[select]

    # ----------------------------------------------------------------- drift
    @torch.no_grad()
    def kl_to_initial(self, sequences: Sequences, micro_batch: int = 8) -> float:
        """Mean over response tokens of KL(π_current ‖ π_initial), exact over the full vocabulary."""
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for mb in sequences.micro_batches(micro_batch):
            if mb.num_response_tokens == 0:
                continue
            logp = F.log_softmax(self.response_logits(mb)[0].float(), dim=-1)  # [N, V]
            with self.initial():
                logp0 = F.log_softmax(self.response_logits(mb)[0].float(), dim=-1)
            total += (logp.exp() * (logp - logp0)).sum().double().cpu()
            count += logp.shape[0]
        if count == 0:
            raise PolicyError("kl_to_initial: the sequences have no response token")
        return float(total) / count

    # ----------------------------------------------------------------- persistence
    def save_adapter(self, out_dir: Path, *, overwrite: bool = False) -> Path:
        """Write the adapter (peft ``save_pretrained``, safetensors) and its version to ``out_dir``, atomically."""
        with _atomic_dir(Path(out_dir), overwrite) as tmp:
            self.peft_model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False)
            (tmp / VERSION_FILE).write_text(
                json.dumps({"policy_version": self.version}) + "\n", encoding="utf-8"
            )
        return Path(out_dir)

    def load_adapter(self, path: Path) -> int:
        """Load the adapter saved at ``path`` into this policy; sets and returns its version."""
        import safetensors.torch
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        path = Path(path)
        try:
            saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
            version = int(json.loads((path / VERSION_FILE).read_text(encoding="utf-8"))["policy_version"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # missing or unparsable files
            raise PolicyError(f"{path}: not a readable policy adapter ({e})") from e
        try:
            state = safetensors.torch.load_file(str(path / ADAPTER_WEIGHTS), device="cpu")
        except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
            raise PolicyError(f"{path}: not a readable policy adapter ({ADAPTER_WEIGHTS}: {e})") from e
        mine = self.lora_config
        for key, want in (("r", mine.r), ("lora_alpha", mine.lora_alpha)):
            if saved.get(key) != want:
                raise PolicyError(f"{path}: adapter {key}={saved.get(key)!r}, this policy has {want!r}")
        if set(saved.get("target_modules") or []) != set(mine.target_modules):
            raise PolicyError(
                f"{path}: adapter target_modules {saved.get('target_modules')}, this policy has "
                f"{sorted(mine.target_modules)}"
            )
        expected = set(get_peft_model_state_dict(self.peft_model))
        if set(state) != expected:
            raise PolicyError(
                f"{path}: adapter tensors differ from this policy's: missing {sorted(expected - set(state))[:3]}, "
                f"unexpected {sorted(set(state) - expected)[:3]}"
            )
        set_peft_model_state_dict(self.peft_model, state)
        self.version = version
        return version

    def save_merged(self, out_dir: Path, tokenizer: Any | None = None, *, overwrite: bool = False) -> Path:
        """A plain HF folder of the merged policy (W + scale·B·A), loadable with AutoModelForCausalLM.

        The merge runs on a deep copy; the live model is never touched.
        """
        merged = copy.deepcopy(self.peft_model).merge_and_unload()
        try:
            with _atomic_dir(Path(out_dir), overwrite) as tmp:
                merged.save_pretrained(str(tmp), safe_serialization=True)
                _carry_unloaded(_source_dir(merged), tmp, set(merged.state_dict()))
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
                (tmp / VERSION_FILE).write_text(
                    json.dumps({"policy_version": self.version}) + "\n", encoding="utf-8"
                )
        finally:
            del merged
        return Path(out_dir)
