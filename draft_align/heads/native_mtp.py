"""A model's own multi-token-prediction (MTP) layers, built from its own config and transformers' decoder layer
(docs/mtp.md).

Only the MTP glue is written here, once for every family; the block is the family's transformers decoder layer
(``Qwen2DecoderLayer`` for MiMo, ``Glm4MoeDecoderLayer`` with its mixture of experts for GLM-4.5,
``DeepseekV3DecoderLayer`` with MLA and experts for DeepSeek-V3), built from
the target's own config with the layer index the checkpoint gives it (N + d).  Depth d at position t::

    e   = embed_target(x[t+1])  (0 at position 0)                    # [H] the target's embedding, frozen
    u   = proj(cat(emb_norm(e), hidden_norm(h)))   (MiMo: cat(hidden_norm(h), emb_norm(e)))
    out = block(u)                                                   # the family's decoder layer
    logits = lm_head(out_norm(out))                                  # the target's head: shared, frozen

``h`` is the target's final post-norm hidden state (HF ``hidden_states[L]``) for step 0 and the previous
step's chained hidden afterwards: ``out`` for GLM-4.5 (vLLM's ``Glm4MoeMultiTokenPredictorLayer`` returns the
pre-norm output and ``compute_logits`` applies ``shared_head.norm``), ``out_norm(out)`` for MiMo (its layer
returns ``final_layernorm(out)``) and DeepSeek-V3 (vLLM 0.32's layer returns ``(out, shared_head(out))`` and
recycles the second).  Step j runs at RoPE position t+j on depth 0 (``steps_run="first"``:
vLLM 0.32's proposer never passes ``spec_step_idx``, so every draft step runs the first MTP layer) or on depth
j mod D (``"cycle"``, what ``spec_step_idx % num_mtp_layers`` would give); its attention sees depth 0's keys of
the committed context 0..t and the earlier steps of its own chain that ran the same depth.

The head's internal tensor names are ``layers.{d}.{emb_norm,hidden_norm,proj,out_norm}.weight``,
``layers.{d}.block.*`` (transformers' names of the layer, experts fused as transformers holds them) and
``lm_head.weight``; :func:`checkpoint_names` maps them to the family's released names.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draft_align.conventions import HeadKind
from draft_align.heads.draft_head import DraftConfigError, SharedHeadConfig, SharedHeadDraft
from draft_align.heads.layers import chain_tokens, next_tokens

StepsRun = typing.Literal["first", "cycle"]
EMBED = "model.embed_tokens.weight"  # the target's input embedding, under every family's checkpoint name


@dataclass(frozen=True)
class MTPFamily:
    """How one model family names and wires its MTP layers (vLLM ``<family>_mtp.py`` is the reference).

    ``prefix``: the checkpoint prefix of depth d, formatted with ``d`` and ``n`` = N + d; ``glue``: our glue
    names → the family's; ``block_prefix``: where the decoder layer's own names start under ``prefix``;
    ``head``: a per-depth copy of the lm_head in the checkpoint (None: the target's ``lm_head.weight``).
    """

    name: str
    architecture: str  # the target's HF ``architectures[0]``
    module: str  # transformers module holding the classes
    layer_class: str
    rotary_class: str
    norm_class: str
    prefix: str
    glue: tuple[tuple[str, str], ...]
    head: str | None
    hidden_first: bool  # proj reads cat(hidden, emb) (MiMo) instead of cat(emb, hidden)
    chain_normed: bool  # the next step reads out_norm(out) (MiMo) instead of out
    depth_field: str = "num_nextn_predict_layers"


#: our glue names, in the order an :class:`MTPFamily` lists its own names for them (``glue``)
GLUE_NAMES = ("emb_norm", "hidden_norm", "proj", "out_norm")


def _family(
    name: str,
    architecture: str,
    model: str,
    classes: str,
    prefix: str,
    glue: tuple[str, str, str, str],
    head: str | None,
    hidden_first: bool,
    chain_normed: bool,
) -> MTPFamily:
    """A family whose block, RoPE and norm are transformers' ``{classes}DecoderLayer``,
    ``{classes}RotaryEmbedding`` and ``{classes}RMSNorm`` in ``transformers.models.{model}``; ``glue``: its
    names of our :data:`GLUE_NAMES`."""
    return MTPFamily(
        name=name,
        architecture=architecture,
        module=f"transformers.models.{model}.modeling_{model}",
        layer_class=f"{classes}DecoderLayer",
        rotary_class=f"{classes}RotaryEmbedding",
        norm_class=f"{classes}RMSNorm",
        prefix=prefix,
        glue=tuple(zip(GLUE_NAMES, glue, strict=True)),
        head=head,
        hidden_first=hidden_first,
        chain_normed=chain_normed,
    )


def _nextn_family(name: str, architecture: str, model: str, classes: str, chain_normed: bool) -> MTPFamily:
    """A family with DeepSeek-V3's MTP ("nextn") layout, which GLM-4.5 reuses: depth d is decoder layer N + d,
    its glue ``enorm``, ``hnorm``, ``eh_proj`` over cat(emb, hidden) and ``shared_head.norm``, and a per-depth
    head copy ``shared_head.head``."""
    return _family(
        name,
        architecture,
        model,
        classes,
        prefix="model.layers.{n}.",
        glue=("enorm", "hnorm", "eh_proj", "shared_head.norm"),
        head="shared_head.head",
        hidden_first=False,
        chain_normed=chain_normed,
    )


FAMILIES: dict[str, MTPFamily] = {
    f.name: f
    for f in (
        _family(
            "mimo",
            "MiMoForCausalLM",
            "qwen2",
            "Qwen2",
            prefix="model.mtp_layers.{d}.",
            glue=("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
            head=None,
            hidden_first=True,
            chain_normed=True,
        ),
        _nextn_family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", "Glm4Moe", chain_normed=False),
        # vLLM 0.32's DeepSeekMTP recycles shared_head.norm(out) (as SGLang's nextn)
        _nextn_family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3", chain_normed=True),
    )
}


def family_of(target_config: Any) -> MTPFamily:
    """The family of an HF target config (by ``architectures[0]``); one line naming the supported ones."""
    arch = (getattr(target_config, "architectures", None) or ["?"])[0]
    for fam in FAMILIES.values():
        if fam.architecture == arch:
            return fam
    known = ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES.values())
    raise DraftConfigError(f"no native MTP family for architecture {arch!r}: supported {known}")


@dataclass(frozen=True)
class NativeMTPConfig(SharedHeadConfig):
    """The target's HF config (as a dict), its family and the MTP depth it ships."""

    family: str
    target_config: dict[str, Any]
    depth: int
    steps_run: StepsRun = "first"  # which depth draft step j runs: "first" (vLLM 0.32) or "cycle" (j mod D)

    def __post_init__(self) -> None:
        if self.steps_run not in typing.get_args(StepsRun):
            raise DraftConfigError(
                f"steps_run {self.steps_run!r}: expected one of {typing.get_args(StepsRun)}"
            )
        if self.family not in FAMILIES:
            raise DraftConfigError(f"native MTP family {self.family!r}: expected one of {sorted(FAMILIES)}")
        if self.depth < 1:
            raise DraftConfigError(f"native MTP depth {self.depth} must be ≥ 1")

    def depth_of_step(self, j: int) -> int:
        """The MTP layer draft step j runs."""
        return j % self.depth if self.steps_run == "cycle" else 0

    @classmethod
    def from_target(cls, target_config: Any, steps_run: StepsRun = "first") -> NativeMTPConfig:
        """From an HF config of a family in :data:`FAMILIES` that ships MTP layers."""
        fam = family_of(target_config)
        depth = int(getattr(target_config, fam.depth_field, 0) or 0)
        if depth < 1:
            raise DraftConfigError(
                f"{fam.architecture} config has {fam.depth_field}={depth}: the target ships no MTP layers"
            )
        return cls(family=fam.name, target_config=target_config.to_dict(), depth=depth, steps_run=steps_run)

    @property
    def spec(self) -> MTPFamily:
        return FAMILIES[self.family]

    @property
    def target_num_layers(self) -> int:
        return int(self.target_config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hf_config(self) -> Any:
        """The family's transformers config with room for the MTP layers (N + D decoder-layer indices, so a
        block is built as layer N + d: dense or mixture of experts as the checkpoint's layer is)."""
        from transformers import AutoConfig

        d = dict(self.target_config)
        model_type = d.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **d)
        cfg = copy.deepcopy(cfg)
        types = getattr(cfg, "layer_types", None)
        if types is not None:
            cfg.layer_types = list(types) + ["full_attention"] * self.depth
        cfg.num_hidden_layers = self.target_num_layers + self.depth
        cfg._attn_implementation = "sdpa"  # a 4-D additive mask: the TTT chains
        cfg._experts_implementation = "eager"  # the experts' own loop (a standalone layer has no dispatch)
        return cfg


class NativeMTPLayer(nn.Module):
    """One depth: the glue around the family's own decoder layer."""

    def __init__(self, fam: MTPFamily, hf_cfg: Any, layer_idx: int) -> None:
        super().__init__()
        mod = importlib.import_module(fam.module)
        norm = getattr(mod, fam.norm_class)
        h, eps = int(hf_cfg.hidden_size), float(hf_cfg.rms_norm_eps)
        self.hidden_first = fam.hidden_first
        self.emb_norm = norm(h, eps=eps)
        self.hidden_norm = norm(h, eps=eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block = getattr(mod, fam.layer_class)(hf_cfg, layer_idx)
        self.out_norm = norm(h, eps=eps)

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden [B, M, H] → proj(cat(...)) [B, M, H] in the family's order."""
        e, h = self.emb_norm(emb), self.hidden_norm(hidden)
        return self.proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))


def _additive(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, 1, Q, K] → 0 / finfo.min float mask (a row with no key allowed stays finite)."""
    return torch.zeros(allow.shape, dtype=dtype, device=allow.device).masked_fill(
        ~allow, torch.finfo(dtype).min
    )


class NativeMTPDraft(SharedHeadDraft):
    """The model's own MTP layers as a draft head (``kind`` "native_mtp"); ``lm_head`` is a frozen copy of the
    target's (``shares_target_head``)."""

    kind: HeadKind = "native_mtp"

    def __init__(self, cfg: NativeMTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers, self.rotary = self._build_blocks(cfg)
        # the target's input embedding [V, H], frozen: never read by the head's math (the trainer passes the
        # target's), kept so a publish can write it into the folder where vLLM's drafter loads it
        self.register_buffer("embed_tokens", torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self._init_shared_head(cfg.hidden_size, cfg.vocab_size)

    def _build_blocks(self, cfg: NativeMTPConfig) -> tuple[nn.ModuleList, nn.Module]:
        """The per-depth layers (each with ``fuse``, ``out_norm`` and a block :meth:`_run` runs) and the RoPE
        module: here the family's transformers layers (heads/megatron_mtp.py builds megatron-core's)."""
        fam, hf_cfg, n = cfg.spec, cfg.hf_config(), cfg.target_num_layers
        layers = nn.ModuleList(NativeMTPLayer(fam, hf_cfg, n + d) for d in range(cfg.depth))
        return layers, getattr(importlib.import_module(fam.module), fam.rotary_class)(hf_cfg)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The MTP tensors under the family's released names (what a publish writes; :func:`to_checkpoint`)."""
        return to_checkpoint(self)

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """Internal names (``layers.{d}.*``, ``lm_head.weight``); :func:`to_checkpoint` maps them."""
        return {
            k: v for k, v in self.state_dict().items() if not k.startswith("rotary.") and k != "embed_tokens"
        }

    # ------------------------------------------------------------------ math
    def _embed(self, embed: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = embed(ids).detach()
        return e * (positions != 0).unsqueeze(-1).to(e.dtype)  # every family zeroes position 0

    def _run(
        self, layer: NativeMTPLayer, x: torch.Tensor, pos: torch.Tensor, allow: torch.Tensor
    ) -> torch.Tensor:
        """The decoder layer on rows x [B, Q, H] at RoPE positions pos [B, Q] with bool mask allow [B, 1, Q, Q]."""
        pe = self.rotary(x, pos)
        return layer.block(
            x, attention_mask=_additive(allow, x.dtype), position_ids=pos, position_embeddings=pe
        )

    def unroll_hidden(
        self,
        aux: torch.Tensor,
        embed: Any,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        starts: torch.Tensor,
        starts_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """Teacher-forced TTT unroll (EAGLE-3's signature).  aux [B, T, H] the target's final post-norm hidden;
        input_ids, valid [B, T]; starts, starts_valid [B, M] chain starts.  Step j of chain s runs depth j mod D
        at position s+j on embed(x[s+1+j]) and predicts x[s+2+j].  Returns ``steps`` tensors [B, M, H]:
        out_norm(out), the lm_head's input.

        Each step runs the decoder layer on every row it attends to (depth 0: the committed context, then the
        chains' rows of that depth so far) under one boolean mask, so transformers' layer runs unchanged; the
        price is that a step recomputes the rows before it.
        """
        b, t = input_ids.shape
        m = starts.shape[1]
        dev = input_ids.device
        pos_all = torch.arange(t, device=dev).expand(b, t)
        x0 = self.layers[0].fuse(
            self._embed(embed, next_tokens(input_ids), pos_all), aux.detach()
        )  # [B, T, H]
        ar = torch.arange(t, device=dev)
        free_ctx = ~valid.unsqueeze(-1)  # padding queries see every key (no all-masked row)
        ctx_ctx = ((ar.view(1, t) <= ar.view(t, 1)).unsqueeze(0) & valid.unsqueeze(1)) | free_ctx  # [B, T, T]
        free = ~starts_valid.unsqueeze(-1)  # [B, M, 1]
        chain_ctx = ((ar.view(1, 1, t) <= starts.unsqueeze(-1)) & valid.unsqueeze(1)) | free  # [B, M, T]
        same = torch.eye(m, dtype=torch.bool, device=dev).expand(b, m, m) | free  # a chain sees its own rows
        none = torch.zeros(b, m, m, dtype=torch.bool, device=dev) | free
        rows: list[list[torch.Tensor]] = [[] for _ in self.layers]
        row_pos: list[list[torch.Tensor]] = [[] for _ in self.layers]
        hidden: list[torch.Tensor] = []
        prev = x0
        for j in range(steps):
            di = self.cfg.depth_of_step(j)
            layer = self.layers[di]
            pos = starts + j
            if j == 0:  # step 0 is the context row at s itself (depth 0 over the committed context)
                out_all = self._run(layer, x0, pos_all, ctx_ctx.unsqueeze(1))  # [B, T, H]
                out = out_all.gather(1, starts.unsqueeze(-1).expand(b, m, out_all.shape[-1]))
                normed = layer.out_norm(out)
                hidden.append(normed)
                prev = normed if self.cfg.spec.chain_normed else out
                continue
            x = layer.fuse(self._embed(embed, chain_tokens(input_ids, starts, j), pos), prev)
            rows[di].append(x)
            row_pos[di].append(pos)
            n = len(rows[di])
            # the chain's i-th row at this depth sees rows 0..i of its own chain at this depth
            chain = [torch.cat([same] * (i + 1) + [none] * (n - i - 1), dim=2) for i in range(n)]
            if di == 0:
                xs = torch.cat([x0, *rows[0]], dim=1)
                ps = torch.cat([pos_all, *row_pos[0]], dim=1)
                top = torch.cat((ctx_ctx, torch.zeros(b, t, n * m, dtype=torch.bool, device=dev)), dim=2)
                allow = torch.cat([top, *(torch.cat((chain_ctx, c), dim=2) for c in chain)], dim=1)
            else:
                xs, ps = torch.cat(rows[di], dim=1), torch.cat(row_pos[di], dim=1)
                allow = torch.cat(chain, dim=1)
            out = self._run(layer, xs, ps, allow.unsqueeze(1))[:, -m:]
            normed = layer.out_norm(out)
            hidden.append(normed)
            prev = normed if self.cfg.spec.chain_normed else out
        return hidden

    # ------------------------------------------------------------------ inference: recomputing
    def new_cache(self) -> NativeMTPCache:
        """An empty per-sequence cache for :meth:`step`."""
        return NativeMTPCache(chain=[[] for _ in self.layers])

    @torch.no_grad()
    def step(
        self,
        cache: NativeMTPCache,
        hidden: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        from_target: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M new rows of one sequence.  ``from_target``: hidden [M, H] is the target's final hidden at committed
        ``positions`` (depth 0; the chain restarts); else hidden [1, H] is the previous step's output and the
        row is the chain's next step.  emb [M, H] embeddings of the next tokens; positions [M].  The layer is
        rerun over every row the new ones attend to (no KV cache).  Returns (logits [M, V], the hidden the next
        step reads [M, H])."""
        if from_target:
            cache.chain_step = 0
            for rows in cache.chain:
                rows.clear()
        else:
            cache.chain_step += 1
        di = self.cfg.depth_of_step(cache.chain_step)
        layer = self.layers[di]
        pos = positions.unsqueeze(0)  # [1, M]
        e = emb.unsqueeze(0) * (pos != 0).unsqueeze(-1).to(emb.dtype)
        x = layer.fuse(e, hidden.unsqueeze(0))  # [1, M, H]
        if from_target:
            cache.context.append((x, pos))
        else:
            cache.chain[di].append((x, pos))
        rows = (cache.context if di == 0 else []) + cache.chain[di]
        xs = torch.cat([r[0] for r in rows], dim=1)
        ps = torch.cat([r[1] for r in rows], dim=1)
        q = xs.shape[1]
        allow = torch.ones(q, q, dtype=torch.bool, device=x.device).tril().view(1, 1, q, q)
        out = self._run(layer, xs, ps, allow)[:, -x.shape[1] :]
        normed = layer.out_norm(out)
        chained = normed if self.cfg.spec.chain_normed else out
        return self.lm_head(normed)[0], chained[0]


@dataclass
class NativeMTPCache:
    """One sequence's rows for :meth:`NativeMTPDraft.step`: the committed context (depth 0's inputs and
    positions) and, per depth, the current chain's rows."""

    chain: list[list[tuple[torch.Tensor, torch.Tensor]]]
    context: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    chain_step: int = 0

    @property
    def length(self) -> int:
        """Committed context rows held."""
        return sum(int(x.shape[1]) for x, _ in self.context)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` context rows (a rejected draft's rows go) and drop the chain."""
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        left = n
        for x, pos in self.context:
            if left <= 0:
                break
            kept.append((x[:, :left], pos[:, :left]))
            left -= int(x.shape[1])
        self.context = kept
        for rows in self.chain:
            rows.clear()


# ---------------------------------------------------------------------- checkpoint names
def _fused_experts(block_sd: Mapping[str, torch.Tensor]) -> bool:
    return any(k.endswith("mlp.experts.gate_up_proj") for k in block_sd)


def checkpoint_names(draft: NativeMTPDraft) -> dict[str, str]:
    """Internal name → the family's released name, for every tensor but the fused expert ones (see
    :func:`to_checkpoint`) and ``lm_head.weight`` (the target's)."""
    fam, n = draft.cfg.spec, draft.cfg.target_num_layers
    out: dict[str, str] = {}
    for d, layer in enumerate(draft.layers):
        pre = fam.prefix.format(d=d, n=n + d)
        for ours, theirs in fam.glue:
            out[f"layers.{d}.{ours}.weight"] = f"{pre}{theirs}.weight"
        for k in layer.block.state_dict():
            if "mlp.experts." not in k:
                out[f"layers.{d}.block.{k}"] = pre + k
    return out


def to_checkpoint(draft: NativeMTPDraft) -> dict[str, torch.Tensor]:
    """The head's tensors under the family's released names: glue, block (experts split per expert:
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, as checkpoints and vLLM's loader name them) and, for a family
    with a per-depth head copy, ``shared_head.head`` (= the lm_head)."""
    fam, n = draft.cfg.spec, draft.cfg.target_num_layers
    sd = draft.engine_state_dict()
    names = checkpoint_names(draft)
    out = {theirs: sd[ours] for ours, theirs in names.items()}
    for d, layer in enumerate(draft.layers):
        pre = fam.prefix.format(d=d, n=n + d)
        bsd = layer.block.state_dict()
        if _fused_experts(bsd):
            gu, dn = bsd["mlp.experts.gate_up_proj"], bsd["mlp.experts.down_proj"]  # [E, 2I, H], [E, H, I]
            inter = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = gu[e, :inter]
                out[f"{pre}mlp.experts.{e}.up_proj.weight"] = gu[e, inter:]
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = dn[e]
        if fam.head is not None:
            out[f"{pre}{fam.head}.weight"] = sd["lm_head.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def require_mtp_tensors(cfg: NativeMTPConfig, tensors: Mapping[str, torch.Tensor]) -> str:
    """The checkpoint prefix of depth 0; a one-line error when ``tensors`` hold no MTP tensor under it."""
    fam = cfg.spec
    first = fam.prefix.format(d=0, n=cfg.target_num_layers)
    if not any(k.startswith(first) for k in tensors):
        raise DraftConfigError(
            f"checkpoint has no MTP tensors ({first}*): this {fam.architecture} checkpoint ships no MTP layers "
            f"(or they were dropped when it was saved)"
        )
    return first


def from_checkpoint(
    cfg: NativeMTPConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> NativeMTPDraft:
    """The head with the checkpoint's own MTP tensors (``tensors``: the target's whole state dict or its MTP
    part plus ``lm_head.weight`` and ``model.embed_tokens.weight``).  One-line errors: no MTP tensors, a
    missing or mis-shaped tensor."""
    with torch.device("meta"):
        draft = NativeMTPDraft(cfg)
    fam, n = cfg.spec, cfg.target_num_layers
    first = require_mtp_tensors(cfg, tensors)
    want = checkpoint_names(draft)
    sd: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for ours, theirs in want.items():
        if theirs in tensors:
            sd[ours] = tensors[theirs]
        else:
            missing.append(theirs)
    head_name = "lm_head.weight"
    if fam.head is not None:
        head_name = f"{first}{fam.head}.weight"
    if head_name not in tensors:
        missing.append(head_name)
    else:
        sd["lm_head.weight"] = tensors[head_name]
    if EMBED not in tensors:
        missing.append(EMBED)
    else:
        sd["embed_tokens"] = tensors[EMBED]
    for d, layer in enumerate(draft.layers):
        pre = fam.prefix.format(d=d, n=n + d)
        bsd = layer.block.state_dict()
        if _fused_experts(bsd):
            n_exp = bsd["mlp.experts.gate_up_proj"].shape[0]
            gu, dn = [], []
            for e in range(n_exp):
                names = [f"{pre}mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
                lost = [x for x in names if x not in tensors]
                if lost:
                    missing += lost
                    continue
                gu.append(torch.cat((tensors[names[0]], tensors[names[1]]), dim=0))
                dn.append(tensors[names[2]])
            if len(gu) == n_exp:
                sd[f"layers.{d}.block.mlp.experts.gate_up_proj"] = torch.stack(gu)
                sd[f"layers.{d}.block.mlp.experts.down_proj"] = torch.stack(dn)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DraftConfigError(f"checkpoint lacks MTP tensors {missing[:3]}{more}")
    own = draft.state_dict()
    for k, v in sd.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DraftConfigError(
                f"MTP tensor for {k} has shape {tuple(v.shape)}, the {fam.architecture} config implies {tuple(own[k].shape)}"
            )
    for k in own:
        if k.startswith("rotary.") or k in sd:
            continue
        if (
            "e_score_correction_bias" in k
        ):  # a buffer some checkpoints leave out: zeros, as transformers starts it
            sd[k] = torch.zeros(own[k].shape, dtype=torch.float32)
            continue
        raise DraftConfigError(f"no checkpoint tensor feeds {k}")
    # copies: the head trains in place and must never write into the caller's checkpoint tensors
    want_dtype = {k: dtype if dtype is not None and v.is_floating_point() else v.dtype for k, v in sd.items()}
    draft.load_state_dict(
        {k: v.detach().to(want_dtype[k], copy=True) for k, v in sd.items()}, strict=False, assign=True
    )
    # non-persistent buffers (RoPE inverse frequencies, vocabulary maps) are rebuilt off the meta device
    fresh_rotary = getattr(importlib.import_module(fam.module), fam.rotary_class)(cfg.hf_config())
    draft.rotary = fresh_rotary
    draft.d2t = torch.zeros(cfg.vocab_size, dtype=torch.long)
    draft.t2d = torch.ones(cfg.vocab_size, dtype=torch.bool)
    for layer in draft.layers:
        for name, buf in list(layer.named_buffers()):
            if buf.is_meta:
                raise DraftConfigError(f"buffer {name} has no value after loading")
    draft.lm_head.weight.requires_grad_(False)
    return draft
