import math

import pytest
import torch

from draft_align.engines.reference import specdec
from draft_align.engines.reference.specdec import SpecDecoder, verify_chain
from draft_align.monitor.evaluate import eos_ids
from tests.helpers import chi2_test, distribution_stats, exact_three

PROMPTS = [[5, 17, 33], [1, 9, 40, 22, 7, 63], [12, 0, 31, 31, 8, 50, 2, 19, 44]]
DRAFTS = ["draft_random48", "draft_random64", "draft_good48"]


def hf_greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :]


# ---------------------------------------------------------------- verify_chain, table-driven
def one_hot_logits(argmaxes, vocab=8):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("target_argmax", "drafts", "expected"),
    [
        ([2, 5, 1, 3], [2, 5, 0], (2, 1)),  # third draft rejected: emit argmax p_3
        ([2, 5, 1, 3], [1, 5, 1], (0, 2)),  # first rejected even though later ones match
        ([2, 5, 1, 3], [2, 5, 1], (3, 3)),  # all accepted: bonus = argmax p_4
        ([4, 6], [4], (1, 6)),
        ([4, 6], [7], (0, 4)),
    ],
)
@pytest.mark.parametrize("mode", ["greedy", "greedy_draft", "probabilistic"])
def test_verify_chain_greedy_table(target_argmax, drafts, expected, mode):
    assert (
        verify_chain(one_hot_logits(target_argmax), torch.tensor(drafts), None, mode, 0.0, None) == expected
    )


def test_verify_chain_greedy_mode_ignores_temperature():
    g = torch.Generator().manual_seed(0)
    out = {
        verify_chain(one_hot_logits([2, 5, 1]), torch.tensor([2, 4]), None, "greedy", 1.0, g)
        for _ in range(20)
    }
    assert out == {(1, 5)}


@pytest.mark.parametrize(
    ("mode", "temp"), [("greedy_draft", 1.0), ("probabilistic", 1.0), ("probabilistic", 0.6)]
)
def test_verify_chain_emits_target_distribution(mode, temp):
    """The first token a round commits (accepted draft, or the correction) is distributed as p_T."""
    g = torch.Generator().manual_seed(1)
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])
    q_logits = torch.tensor([1.0, 2.5, 0.0, 0.5, 0.0, 1.0])
    q = torch.softmax(q_logits / temp, -1)
    counts = torch.zeros(6)
    n_acc = 0
    for _ in range(6000):
        d = int(q.argmax()) if mode == "greedy_draft" else int(torch.multinomial(q, 1, generator=g))
        n, y = verify_chain(p_logits, torch.tensor([d]), q[None], mode, temp, g)
        counts[d if n == 1 else y] += 1
        n_acc += n
    stat, crit = chi2_test(counts, torch.softmax(p_logits[0] / temp, -1))
    assert stat < crit
    assert 500 < n_acc < 5500  # both paths taken


# ---------------------------------------------------------------- T = 0: output == HF greedy
@pytest.mark.parametrize("draft_name", DRAFTS)
@pytest.mark.parametrize("mode", ["greedy", "greedy_draft", "probabilistic"])
def test_t0_is_hf_greedy(request, target, draft_name, mode):
    draft = request.getfixturevalue(draft_name)
    for prompt in PROMPTS:
        ref = hf_greedy(target, prompt, 20)
        for k in (1, 3, 5):
            dec = SpecDecoder(target, draft, k, mode, 0.0)
            out, tally = dec.generate(torch.tensor(prompt), 20, eos_ids(target, None), torch.Generator())
            assert out.tolist() == ref.tolist(), (prompt, k)
            assert tally.rounds >= math.ceil((len(ref) - 1) / (k + 1))
    if draft_name == "draft_good48":  # acceptance paths were exercised
        out, tally = SpecDecoder(target, draft, 3, mode, 0.0).generate(torch.tensor(PROMPTS[1]), 40)
        assert tally.mean_length() > 2.0
        assert tally.accepted_per_pos[2] > 0


def test_eos_and_limit(target, draft_good48):
    prompt = torch.tensor(PROMPTS[2])
    ref = hf_greedy(target, PROMPTS[2], 30).tolist()
    eos = ref[11]
    cut = ref[: ref.index(eos) + 1]
    dec = SpecDecoder(target, draft_good48, 3, "greedy_draft", 0.0)
    out, _ = dec.generate(prompt, 30, {eos})
    assert out.tolist() == cut
    for n in (1, 2, 7):
        out, tally = dec.generate(prompt, n)
        assert out.tolist() == ref[:n]
        assert (tally.rounds == 0) == (n == 1)
    assert dec.generate(prompt, 0)[0].numel() == 0


def test_greedy_mode_decodes_greedily_at_any_temperature(target, draft_good48):
    ref = hf_greedy(target, PROMPTS[0], 15).tolist()
    out, _ = SpecDecoder(target, draft_good48, 3, "greedy", 1.0).generate(
        torch.tensor(PROMPTS[0]), 15, set(), torch.Generator().manual_seed(3)
    )
    assert out.tolist() == ref


def test_seeded_determinism(target, draft_good48):
    dec = SpecDecoder(target, draft_good48, 3, "probabilistic", 1.0)
    a = dec.generate(torch.tensor(PROMPTS[1]), 25, set(), torch.Generator().manual_seed(11))
    b = dec.generate(torch.tensor(PROMPTS[1]), 25, set(), torch.Generator().manual_seed(11))
    c = dec.generate(torch.tensor(PROMPTS[1]), 25, set(), torch.Generator().manual_seed(12))
    assert a[0].tolist() == b[0].tolist() and a[1] == b[1]
    assert a[0].tolist() != c[0].tolist()


# ---------------------------------------------------------------- T > 0: output distribution == target's
STAT_PROMPT = [7, 30, 3, 51]
Z_CRIT = 3.29  # two-sided p = 1e-3


@pytest.fixture(scope="module")
def exact(target):
    """temperature → exact target statistics of the 3 tokens after STAT_PROMPT (tests.helpers.exact_three)."""
    cache = {}

    def get(temp):
        if temp not in cache:
            cache[temp] = exact_three(target, STAT_PROMPT, temp)
        return cache[temp]

    return get


def sample_three(target, draft, k, mode, temp, n, seed):
    """n independent 3-token continuations of STAT_PROMPT: (tokens [n, 3], rounds, accepted drafts)."""
    dec = SpecDecoder(target, draft, k, mode, temp)
    g = torch.Generator().manual_seed(seed)
    outs, rounds, accepted = [], 0.0, 0.0
    for _ in range(n):
        out, tally = dec.generate(torch.tensor(STAT_PROMPT), 3, set(), g)
        outs.append(out)
        rounds += tally.rounds
        accepted += tally.num_accepted
    return torch.stack(outs), rounds, accepted


N_SAMPLES = 600


@pytest.mark.parametrize(
    ("mode", "temp", "k"),
    [
        ("greedy_draft", 1.0, 2),
        ("probabilistic", 1.0, 2),
        ("greedy_draft", 0.7, 1),
        ("probabilistic", 0.7, 1),
    ],
)
def test_output_distribution_matches_target(target, draft_good48, exact, mode, temp, k):
    outs, rounds, accepted = sample_three(target, draft_good48, k, mode, temp, N_SAMPLES, seed=100)
    assert 0.2 * rounds < accepted < 0.9 * rounds * k  # acceptance and rejection both exercised
    chi2, z = distribution_stats(outs, exact(temp))
    for i, (stat, crit) in enumerate(chi2):
        assert stat < crit, f"token {i + 1}: χ² {stat:.1f} ≥ {crit:.1f}"
    assert all(abs(zi) < Z_CRIT for zi in z), z


def accept_always(p_logits, drafts, q_probs, mode, temperature, generator):
    k = drafts.numel()
    return k, int(torch.multinomial(torch.softmax(p_logits[k] / temperature, -1), 1, generator=generator))


def residual_keeps_draft(p_logits, drafts, q_probs, mode, temperature, generator):
    """A classic bug: on rejection resample from p_T itself, the rejected draft not removed."""
    p_t = torch.softmax(p_logits.float() / temperature, -1)
    for i, d in enumerate(drafts.tolist()):
        if torch.rand((), generator=generator).item() >= p_t[i, d]:
            return i, int(torch.multinomial(p_t[i], 1, generator=generator))
    return drafts.numel(), int(torch.multinomial(p_t[-1], 1, generator=generator))


def test_distribution_test_detects_accept_always(monkeypatch, target, draft_good48, exact):
    monkeypatch.setattr(specdec, "verify_chain", accept_always)
    outs, _, _ = sample_three(target, draft_good48, 2, "probabilistic", 1.0, N_SAMPLES, seed=100)
    chi2, _ = distribution_stats(outs, exact(1.0))
    assert chi2[1][0] > 4 * chi2[1][1] and chi2[2][0] > 4 * chi2[2][1]


def test_distribution_test_detects_biased_residual(monkeypatch, target, draft_good48, exact):
    monkeypatch.setattr(specdec, "verify_chain", residual_keeps_draft)
    outs, _, _ = sample_three(target, draft_good48, 2, "greedy_draft", 1.0, N_SAMPLES, seed=100)
    _, z = distribution_stats(outs, exact(1.0))
    assert max(z) > 1.5 * Z_CRIT  # towards the drafts, well past what the lossless test tolerates
