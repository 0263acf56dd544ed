"""Reference chain speculative decoder (batch size 1): an HF causal LM target and a draft head (EAGLE-3 or MTP).

Follows vLLM's EAGLE path.  The target prefills the prompt (aux states captured by an :class:`HFTap`)
and samples x_P.  The draft's KV cache holds one *target-derived* row per committed position t: the aux
states at t and the embedding of x[t+1], at RoPE position t.  A round with C committed tokens:

1. the draft's last target-derived row (position C−2) gives d_1; step j (position C−2+j) reads the
   previous step's pre-norm hidden and embed(d_j) and gives d_{j+1}, up to k drafts;
2. the target runs [x_{C−1}, d_1..d_k] in one cached forward → p_1..p_{k+1} and their aux states;
3. :func:`verify_chain` accepts n drafts and emits one more token y (correction, or bonus from p_{k+1});
4. the target cache is cropped to the committed length; the draft cache drops its speculative rows and
   appends the target-derived rows of positions C−1..C+n−1 (aux from step 2, embeddings of d_1..d_n, y).

Verification (T = temperature, p_T = softmax(p/T), q_T = softmax(q/T) on the target vocab):

- T = 0 or ``greedy``: accept d_i iff d_i = argmax p_i; on reject emit argmax p_i.  ``greedy`` decodes by
  argmax at any T (the prefill token and the bonus too): it models an engine that verifies by argmax,
  whose output is the target's greedy output, not a T-sample.
- ``greedy_draft`` (d_i = argmax q): accept with probability p_T(d_i); on reject sample from p_T with
  d_i removed, renormalised (vLLM with no draft probabilities: q is one-hot).
- ``probabilistic`` (d_i ~ q_T): accept with min(1, p_T(d_i)/q_T(d_i)); on reject sample from
  norm(max(0, p_T − q_T)).
- all k accepted: sample the bonus token from p_{T,k+1} (argmax at T = 0).

Stopping: at the first eos, or at ``max_new_tokens`` (the last round's tokens are cut there).  The tally
counts each round's accepted drafts as vLLM's counters do, before the cut: a final round that accepts
drafts past the limit (or past an eos) still counts them.
"""

from __future__ import annotations

import torch
from torch import nn

from draft_align.acceptance import (
    AcceptanceTally,
    VerifyMode,
    check_mode,
    draft_probs_on_target,
    verifies_by_argmax,
)
from draft_align.heads.draft_head import DraftHead
from draft_align.hf.capture import HFTap
from draft_align.hf.parts import decoder_parts


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # probs [V], non-negative, not necessarily normalised
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device).item())


def verify_chain(
    p_logits: torch.Tensor,  # [k+1, V] target logits: row i is the distribution of draft i's position
    drafts: torch.Tensor,  # [k] draft tokens as target ids
    q_probs: torch.Tensor | None,  # [k, V] draft probabilities q_T on the target vocab (probabilistic)
    mode: VerifyMode,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Verify one chain; returns (n accepted drafts in 0..k, the next token y).

    The committed tokens of the round are drafts[:n] followed by y.  Rules in the module docstring;
    ``q_probs`` is needed only for ``probabilistic`` at T > 0.
    """
    k = drafts.numel()
    d = drafts.tolist()
    if verifies_by_argmax(mode, temperature):
        best = p_logits.argmax(-1).tolist()
        n = 0
        while n < k and d[n] == best[n]:
            n += 1
        return n, best[n]
    p_t = torch.softmax(p_logits.float() / temperature, dim=-1)
    for i in range(k):
        if mode == "greedy_draft":
            ratio = float(p_t[i, d[i]])
        else:
            if q_probs is None:
                raise ValueError("probabilistic verification needs the draft probabilities q_probs")
            ratio = min(1.0, float(p_t[i, d[i]]) / float(q_probs[i, d[i]]))
        if _uniform(generator, p_t.device) < ratio:
            continue
        if mode == "greedy_draft":
            residual = p_t[i].clone()
            residual[d[i]] = 0.0
        else:
            residual = (p_t[i] - q_probs[i].float()).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p_t[i]
        return i, _sample(residual, generator)
    return k, _sample(p_t[k], generator)


class SpecDecoder:
    """Chain speculative decoding of one sequence at a time; see the module docstring."""

    def __init__(
        self,
        target: nn.Module,
        draft: DraftHead,
        k: int,
        mode: VerifyMode,
        temperature: float,
        aux_layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        check_mode(mode)
        if k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        if temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {temperature}")
        self.target = target
        self.draft = draft
        self.k = k
        self.mode: VerifyMode = mode
        self.temperature = float(temperature)
        self.aux_layer_ids = tuple(aux_layer_ids if aux_layer_ids is not None else draft.cfg.aux_layer_ids)
        self.embed = decoder_parts(target)[0]
        self.argmax = verifies_by_argmax(mode, temperature)

    def _target_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        # logits [V] → the target's own sample (argmax where verification is by argmax)
        if self.argmax:
            return int(logits.argmax())
        return _sample(torch.softmax(logits.float() / self.temperature, dim=-1), generator)

    def _propose(
        self, q_logits: torch.Tensor, d2t: torch.Tensor, vocab: int, generator: torch.Generator | None
    ) -> tuple[int, torch.Tensor | None]:
        # q_logits [Vd] → (target id of the draft token, q_T on the target vocab [V] if probabilistic)
        if self.argmax or self.mode == "greedy_draft":
            return int(d2t[q_logits.argmax()]), None
        q = torch.softmax(q_logits.float() / self.temperature, dim=-1)
        return int(d2t[_sample(q, generator)]), draft_probs_on_target(q, d2t, vocab)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,  # [P] token ids
        max_new_tokens: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, AcceptanceTally]:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; returns (new tokens [N], tally).

        ``generator`` (on the target's device) drives every random draw; None uses torch's global RNG.
        """
        from transformers import DynamicCache

        target, draft, k = self.target, self.draft, self.k
        dev = next(target.parameters()).device
        ddtype = next(draft.parameters()).dtype
        prompt = prompt_ids.to(dev, torch.long).flatten()
        if prompt.numel() < 1:
            raise ValueError("empty prompt")
        tally = AcceptanceTally.empty(k)
        new: list[int] = []
        if max_new_tokens <= 0:
            return torch.tensor(new, dtype=torch.long, device=prompt_ids.device), tally
        d2t = draft.draft_to_target.to(dev)

        def embed(tokens: list[int]) -> torch.Tensor:  # [M] → [M, H] in the draft's dtype
            return self.embed(torch.tensor(tokens, dtype=torch.long, device=dev)).to(ddtype)

        def commit(tokens: list[int]) -> bool:  # True when generation is over
            for t in tokens:
                new.append(t)
                if t in eos_token_ids or len(new) >= max_new_tokens:
                    return True
            return False

        cache = DynamicCache(config=target.config)
        with HFTap(target, self.aux_layer_ids, capture_final=False) as tap:
            out = target(input_ids=prompt[None], past_key_values=cache, use_cache=True)
            pending_aux = tap.pop().aux[0]  # [P, n·H] target-derived rows not yet in the draft cache
            vocab = out.logits.shape[-1]
            seq = prompt.tolist()
            seq.append(self._target_token(out.logits[0, -1], generator))
            done = commit(seq[-1:])
            first_pending = 0  # position of pending_aux[0]
            dcache = draft.new_cache()
            while not done:
                c = len(seq)  # committed tokens; the target cache holds c − 1 of them
                positions = torch.arange(first_pending, c - 1, device=dev)
                q_logits, hid = draft.step(
                    dcache,
                    pending_aux.to(ddtype),
                    embed(seq[first_pending + 1 : c]),
                    positions,
                    from_target=True,
                )
                base = dcache.length  # == c − 1 target-derived rows
                drafts: list[int] = []
                q_rows: list[torch.Tensor] = []
                q_last, h = q_logits[-1], hid[-1:]
                for j in range(k):
                    tok, q_full = self._propose(q_last, d2t, vocab, generator)
                    drafts.append(tok)
                    if q_full is not None:
                        q_rows.append(q_full)
                    if j + 1 < k:  # draft step j+1 at position (c − 2) + (j + 1)
                        lg, h = draft.step(
                            dcache, h, embed([tok]), torch.tensor([c - 1 + j], device=dev), from_target=False
                        )
                        q_last = lg[0]
                verify_ids = torch.tensor([seq[-1], *drafts], dtype=torch.long, device=dev)
                out = target(input_ids=verify_ids[None], past_key_values=cache, use_cache=True)
                verify_aux = tap.pop().aux[0]  # [k+1, n·H] at positions c−1 .. c−1+k
                n, y = verify_chain(
                    out.logits[0],
                    torch.tensor(drafts, dtype=torch.long, device=dev),
                    torch.stack(q_rows) if q_rows else None,
                    self.mode,
                    self.temperature,
                    generator,
                )
                tally.add(n)
                if k - n > 0:
                    cache.crop(-(k - n))  # negative = tokens to remove, in transformers 4.x and 5.x
                dcache.truncate(base)
                emitted = [*drafts[:n], y]
                seq.extend(emitted)
                pending_aux = verify_aux[: n + 1]
                first_pending = c - 1
                done = commit(emitted)
        return torch.tensor(new, dtype=torch.long, device=prompt_ids.device), tally
