"""The draft loop: one for every network draft, one session or many at once.

A network draft (a small decoder, a feature draft) proposes a token per forward. What every such draft must
respect lives here, once: tokens the request's grammar forces are proposed as they are and do not count against
k (the head need not run for them), a step proposes at most `limit` tokens in all, a draft stops at its first
unsure token (`p_min`), and with a generator each token comes with its distribution over the target's
vocabulary (one-hot for a forced one), rejection sampling's q. A draft supplies only its forward
(`NetworkSession.forward`): the next logits of each session, from the input `begin` and `feed` prepared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from app.engine.decoding.grammar import GrammarState
from app.engine.decoding.penalties import Penalty
from app.engine.decoding.sampling import GumbelNoise, SamplingParams, argmax, gumbel_choice, sample, warp
from app.engine.drafting.base import DraftSession, Randomness
from app.engine.drafting.tree import Candidates


def choose_draft_token(
    logits: Tensor,
    params: SamplingParams | None,
    rng: Randomness,
    p_min: float,
    position: int = 0,
    ids: Tensor | None = None,
    penalty: Penalty | None = None,
    drafted: Sequence[int] = (),
    grammar: GrammarState | None = None,
    value: float = 1.0,
    value_min: float = 0.0,
) -> tuple[int, Tensor | None, float] | None:
    """One drafted token from a draft's `logits` [V'] for sequence `position`: (index into V', None) greedily
    or by the Gumbel-max trick on the target's noise (`rng` a GumbelNoise; `ids` long [V']: the token id of
    each logit, None when logit i is token i), or (index, warped distribution [V']) drawn with a generator,
    the q of rejection sampling. None when the draft's top probability is below `p_min` (the confidence
    cut-off, llama.cpp's --draft-p-min: an unsure guess is more likely rejected than accepted, and each
    further token costs a draft step). `penalty`: the request's penalties, over its accepted sequence plus
    `drafted` (this step's proposals so far). `grammar`: the request's grammar, whose allowed tokens after the
    accepted sequence plus `drafted` are the only ones proposed (None when it allows none of the draft's).
    `value`: the product of the chain's top probabilities before this token; None where it times this token's falls
    below `value_min` (0: never), else the new product is returned third (1.0 where neither cut-off asks for it)."""
    if penalty is not None:
        logits = penalty.apply(logits[None], drafted, ids)[0]
    if grammar is not None:
        allowed = grammar.allowed(drafted)
        if allowed is None:
            return None
        allowed = allowed.to(logits.device) if ids is None else allowed.to(logits.device)[ids]
        if not bool(allowed.any()):
            return None
        logits = torch.where(allowed, logits, torch.tensor(float("-inf"), device=logits.device))
    if params is None or params.greedy:
        choice: tuple[int, Tensor | None] = (int(argmax(logits.float())), None)
    elif isinstance(rng, GumbelNoise):
        choice = (gumbel_choice(logits, params, rng, position, ids), None)
    else:
        probs = warp(logits, params)
        choice = (int(sample(probs, rng)), probs)
    if p_min <= 0 and value_min <= 0:
        return (*choice, 1.0)
    top = float(torch.softmax(logits.float(), -1).max())
    if top < p_min or value * top < value_min:
        return None
    return (*choice, value * top)


def drawn(params: SamplingParams | None, rng: Randomness) -> bool:
    """Whether draft tokens are drawn with a generator, so that each needs its distribution (rejection sampling)."""
    return params is not None and not params.greedy and not isinstance(rng, GumbelNoise)


def one_hot(token: int, vocab: int, device: torch.device) -> Tensor:
    """A forced token's q [vocab]: proposed for certain."""
    q = torch.zeros(vocab, device=device)
    q[token] = 1.0
    return q


class NetworkSession(DraftSession):
    """A session whose draft is a network run one position at a time, driven by `run_drafts`.

    Subclasses set `vocab_ids` (the target id of each draft logit, long [V']; None: logit i is token i),
    `target_vocab` (q's width) and `device`, and define `begin`, `feed` and `forward`."""

    vocab_ids: Tensor | None = None
    target_vocab: int = 0
    device: torch.device = torch.device("cpu")
    # A greedy `propose` stops before a token where the product of the chain's top probabilities falls below this:
    # the schedule's price of a verified row as a share of a target step (`DraftLength.value_floor`), set by the
    # generation before each draft. The draft's top probability is close to how often the target agrees (docs/bench),
    # so a token below it is expected to save less than its row costs.
    value_min: float = 0.0

    def propose(self, token_ids: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        return run_drafts([self], [token_ids], [k], [p_min], value_mins=[self.value_min])[0][0]

    def propose_sampled(
        self, token_ids: Sequence[int], k: int, params: SamplingParams, rng: Randomness, p_min: float = 0.0
    ) -> tuple[list[int], Tensor | None]:
        return run_drafts([self], [token_ids], [k], [p_min], params, rng)[0]

    def begin(self, token_ids: Sequence[int], k: int) -> int:
        """Ready the first forward of a step after `token_ids` (roll the cache back, catch up on what the
        draft has not seen); the most tokens the step may propose, forced ones included (0: none)."""
        raise NotImplementedError

    def feed(self, token: int) -> None:
        """`token` was proposed: the next forward reads it."""
        raise NotImplementedError

    def chain(self, k: int, p_min: float, value_min: float) -> list[int] | None:
        """Right after `begin`: the greedy draft of up to `k` tokens with the cut-offs `p_min` and `value_min`
        (`choose_draft_token`'s) in one go, as the loop would propose it token by token without a grammar or
        penalties (None: the loop runs it). A draft token's Python and torch operations, each run cold after the
        draft's weights went through the caches, cost more than its arithmetic."""
        return None

    def readable(self, token: int) -> bool:
        """Whether the draft can read `token` (a forced token outside its vocabulary ends its step)."""
        return True

    @classmethod
    def forward(cls, sessions: Sequence[NetworkSession], heads: Sequence[bool], batched: bool) -> list[Tensor | None]:
        """One forward of every session (all of this class and drafter) over its prepared input; per session its
        next logits [V'], where `heads` asks for them (None otherwise: a forced token needs no head). `batched`:
        the sessions draft together (`Drafter.propose_batch`), even when one is left: a batched forward's last
        bits may differ from a lone one's, so a draft takes one path from its first position to its last."""
        raise NotImplementedError


@torch.inference_mode()
def run_drafts(
    sessions: Sequence[NetworkSession],
    token_ids: Sequence[Sequence[int]],
    ks: Sequence[int],
    p_mins: Sequence[float],
    params: SamplingParams | None = None,
    rng: Randomness = None,
    found: Candidates | None = None,
    width: int = 0,
    value_mins: Sequence[float] | None = None,
) -> list[tuple[list[int], Tensor | None]]:
    """Each session's draft of up to `ks[i]` own tokens after `token_ids[i]`: (tokens, q [len, target vocab] when
    drawn with a generator, else None). Sessions share each forward (`NetworkSession.forward`). `found` (one
    session): filled with the chain's tokens, their draft probabilities and the next `width` choices at each
    depth (by probability), a tree's material. `value_mins`: each greedy chain's `choose_draft_token` value cut-off
    (None: none)."""
    assert found is None or len(sessions) == 1
    out: list[list[int]] = [[] for _ in sessions]
    dists: list[list[Tensor]] = [[] for _ in sessions]
    own = [0] * len(sessions)
    limits = [s.begin(ids, k) if k > 0 else 0 for s, ids, k in zip(sessions, token_ids, ks, strict=True)]
    active = [i for i, limit in enumerate(limits) if limit > 0]
    keep_q = drawn(params, rng)
    batched = len(sessions) > 1
    greedy = params is None or params.greedy
    floors = list(value_mins) if value_mins is not None and greedy and found is None else [0.0] * len(sessions)
    values = [1.0] * len(sessions)
    if not batched and found is None and active and greedy:
        s = sessions[0]
        if s.grammar is None and s.penalty is None:
            chained = s.chain(min(ks[0], limits[0]), p_mins[0], floors[0])
            if chained is not None:
                return [(chained, None)]
    while active:
        forced = [sessions[i].grammar.forced(out[i]) if sessions[i].grammar is not None else None for i in active]
        heads = [f is None for f in forced]
        logits = type(sessions[active[0]]).forward([sessions[i] for i in active], heads, batched)
        going = []
        for i, tok, lg in zip(active, forced, logits, strict=True):
            s = sessions[i]
            if tok is not None:
                if not s.readable(tok):
                    continue
                if keep_q:
                    dists[i].append(one_hot(tok, s.target_vocab, s.device))
            else:
                assert lg is not None
                position = len(token_ids[i]) + len(out[i])
                choice = choose_draft_token(
                    lg,
                    params,
                    rng,
                    p_mins[i],
                    position,
                    s.vocab_ids,
                    s.penalty,
                    out[i],
                    s.grammar,
                    value=values[i],
                    value_min=floors[i],
                )
                if choice is None:
                    continue
                idx, warped, values[i] = choice
                own[i] += 1
                tok = _target_id(idx, s.vocab_ids)
                if found is not None:
                    _record(found, lg, idx, width, s.vocab_ids)
                if warped is not None:
                    dists[i].append(_over_target_vocab(warped, s.vocab_ids, s.target_vocab))
            out[i].append(tok)
            if own[i] < ks[i] and len(out[i]) < limits[i]:
                s.feed(tok)
                going.append(i)
        active = going
    return [(tokens, torch.stack(q) if q else None) for tokens, q in zip(out, dists, strict=True)]


def _record(found: Candidates, logits: Tensor, idx: int, width: int, vocab_ids: Tensor | None) -> None:
    """A chosen token with its draft probability and the draft's next `width` choices, by probability."""
    probs = torch.softmax(logits.float(), -1)
    top = torch.topk(probs, min(width + 1, probs.shape[0]))
    found.probs.append(float(probs[idx]))
    found.alternatives.append(
        [(_target_id(i, vocab_ids), float(p)) for p, i in zip(top.values, top.indices, strict=True) if i != idx][:width]
    )
    found.tokens.append(_target_id(idx, vocab_ids))


def _target_id(index: int | Tensor, vocab_ids: Tensor | None) -> int:
    """The target's token id of a draft logit's `index` (`vocab_ids` None: the same)."""
    return int(index) if vocab_ids is None else int(vocab_ids[index])


def _over_target_vocab(q: Tensor, vocab_ids: Tensor | None, vocab: int) -> Tensor:
    """A draft's distribution [V'] spread over the target's vocabulary [vocab]: ids it cannot propose have q = 0."""
    if vocab_ids is None:
        return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    full = torch.zeros(vocab, dtype=q.dtype, device=q.device)
    full[vocab_ids] = q
    return full
