"""Drafters (app/engine/drafting/): prompt lookup (n-gram) and a model draft with its own KV cache."""

from __future__ import annotations

import random

import pytest
import torch

from app.engine.decoding.sampling import SamplingParams
from app.engine.drafting.base import Drafter, DraftError, DraftSession
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.model.loading import LoadedModel
from app.engine.reference import greedy_decode

# --- n-gram (prompt lookup) -------------------------------------------------------------------------------

#             0  1  2  3  4  5  6  7  8  9 10 11
SEQ = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]


def _propose(ids, k, **kwargs):
    return NgramDrafter(**kwargs).session(capacity=100).propose(ids, k)


def test_ngram_proposes_the_continuation_of_the_latest_earlier_occurrence():
    # The tail [1, 2, 3] occurred at 0 (followed by 9) and at 4 (followed by 7, 5, ...): the latest wins.
    assert _propose(SEQ, 3) == [7, 5, 1]


@pytest.mark.parametrize(("k", "expected"), [(1, [7]), (2, [7, 5]), (4, [7, 5, 1, 2]), (50, [7, 5, 1, 2, 3])])
def test_ngram_respects_k(k, expected):
    assert _propose(SEQ, k) == expected


def test_ngram_returns_nothing_when_nothing_matches():
    assert _propose([1, 2, 3, 4], 3) == []
    assert _propose([4], 3) == []
    assert _propose(SEQ, 0) == []


def test_ngram_prefers_the_longest_match():
    ids = [5, 6, 7, 8, 9, 7, 1, 5, 6, 7]
    # The 3-gram [5, 6, 7] occurred at 0 (followed by 8); the 1-gram [7] more recently at 5 (followed by 1).
    assert _propose(ids, 2) == [8, 9]
    assert _propose(ids, 2, max_n=1) == [1, 5]


def test_ngram_min_n():
    ids = [4, 1, 2, 9, 3, 2]  # only the 1-gram [2] occurred before (followed by 9)
    assert _propose(ids, 2) == [9, 3]
    assert _propose(ids, 2, max_n=3, min_n=2) == []


def test_ngram_overlapping_match():
    assert _propose([5, 5, 5, 5], 3) == [5]


def test_ngram_bounds():
    with pytest.raises(ValueError):
        NgramDrafter(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramDrafter(max_n=2, min_n=0)


# --- a model draft -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(make_tiny_model, word_tokenizer):
    tok = word_tokenizer(64)
    target = LoadedModel(make_tiny_model(seed=1, vocab_size=64), tok, "target", 0.0)
    draft = LoadedModel(make_tiny_model(seed=2, vocab_size=64, n_layers=1), tok, "draft", 0.0)
    return target, draft


def test_model_draft_proposes_its_greedy_continuation_across_rollbacks(pair):
    target, draft = pair
    session = ModelDrafter("tiny", draft, target).session(capacity=40)
    a = [3, 14, 15, 9, 26, 5]
    first = session.propose(a, 4)
    assert first == greedy_decode(draft.model, a, 4)
    assert session._cache.length == len(a) + 4 - 1  # the last proposal is never fed

    # Two proposals accepted, the third replaced by another token: the cache must roll back to it.
    wrong = (first[2] + 1) % 64
    b = [*a, *first[:2], wrong]
    assert session.propose(b, 3) == greedy_decode(draft.model, b, 3)
    assert session._cache.length == len(b) + 3 - 1

    # An unrelated, shorter sequence (nothing shared but nothing stale may leak), then extend it.
    c = [7, 7, 1]
    assert session.propose(c, 2) == greedy_decode(draft.model, c, 2)
    d = [*c, 60, 61, 62, 2]
    assert session.propose(d, 5) == greedy_decode(draft.model, d, 5)
    assert session.propose(d, 1) == greedy_decode(draft.model, d, 1)
    assert session.propose(d, 0) == []


def test_model_draft_stops_at_the_session_capacity(pair):
    target, draft = pair
    session = ModelDrafter("tiny", draft, target).session(capacity=8)
    ids = [1, 2, 3, 4, 5, 6, 7]
    assert session.propose(ids, 4) == greedy_decode(draft.model, ids, 2)  # room for one more fed token
    full = [*ids, 8]
    assert session.propose(full, 4) == greedy_decode(draft.model, full, 1)


def test_model_draft_with_a_shorter_context_than_the_request(pair, make_tiny_model):
    target, draft = pair
    short = LoadedModel(make_tiny_model(seed=2, vocab_size=64, n_layers=1, max_seq_len=10), draft.tokenizer, "s", 0.0)
    session = ModelDrafter("short", short, target).session(capacity=40)  # more than the draft's context
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    assert session.propose(ids, 4) == greedy_decode(short.model, ids, 3)  # positions up to 9 only
    assert session.propose([*ids, 9, 10], 4) == greedy_decode(short.model, [*ids, 9, 10], 1)
    assert session.propose([*ids, 9, 10, 11], 4) == []  # past the draft's context: nothing


def test_model_draft_never_proposes_ids_the_target_cannot_verify(make_tiny_model, word_tokenizer):
    tok = word_tokenizer(64)
    target = LoadedModel(make_tiny_model(seed=1, vocab_size=64), tok, "target", 0.0)
    wide = make_tiny_model(seed=3, vocab_size=80, tie_embeddings=False)
    with torch.no_grad():
        # A padded head whose extra rows (64 and 65) dominate: +-100 along the first hidden dimension.
        wide.lm_head.weight.mul_(0.01)
        wide.lm_head.weight[64:] = 0
        wide.lm_head.weight[64, 0], wide.lm_head.weight[65, 0] = 100.0, -100.0
    draft = LoadedModel(wide, tok, "wide", 0.0)
    ids = [5, 9, 13, 2]
    with torch.no_grad():
        assert int(wide(torch.tensor([ids]))[0, -1].argmax()) >= 64  # the setup: unrestricted, it would
    proposals = ModelDrafter("wide", draft, target).session(capacity=20).propose(ids, 4)
    expected, seq = [], list(ids)
    with torch.no_grad():
        for _ in range(4):
            expected.append(int(wide(torch.tensor([seq]))[0, -1, :64].argmax()))
            seq.append(expected[-1])
    assert proposals == expected
    assert all(p < 64 for p in proposals)


def test_a_draft_with_another_vocabulary_is_refused(make_tiny_model, word_tokenizer, byte_tokenizer):
    target = LoadedModel(make_tiny_model(seed=1, vocab_size=64), word_tokenizer(64), "target", 0.0)
    bigger = LoadedModel(make_tiny_model(seed=2, vocab_size=65), word_tokenizer(65), "bigger", 0.0)
    with pytest.raises(DraftError, match="'bigger' does not share the target's vocabulary") as err:
        ModelDrafter("bigger", bigger, target)
    assert "65 vs 64 tokens" in str(err.value)
    other = LoadedModel(make_tiny_model(seed=2, vocab_size=257), byte_tokenizer(), "bytes", 0.0)
    with pytest.raises(DraftError, match="must use the target's tokenizer"):
        ModelDrafter("bytes", other, target)


class _Recorder(Drafter, DraftSession):
    """A model draft stand-in that proposes fixed tokens and records each call."""

    name = "recorder"

    def __init__(self) -> None:
        DraftSession.__init__(self)
        self.calls: list[tuple[int, int, float]] = []
        self.features = object()  # type: ignore[assignment]

    def session(self, capacity: int) -> _Recorder:
        return self

    def propose(self, token_ids, k, p_min=0.0):
        self.calls.append((len(token_ids), k, p_min))
        return [7] * k


def test_hybrid_uses_the_lookup_on_a_long_match_and_the_model_otherwise():
    model = _Recorder()
    session = HybridDrafter("hybrid", model).session(100)
    assert session.features is model.features  # a feature draft's buffer is the generation's to fill
    # "1 2 3" recurs: the lookup proposes what followed it, the model is not asked.
    assert session.propose([1, 2, 3, 9, 8, 1, 2, 3], 3) == [9, 8, 1]
    assert model.calls == []
    # Only the last token recurs (a match of 1, which unpriced the model draft beats): the model drafts, with the
    # cut-off passed on.
    assert session.propose([1, 2, 3, 9, 8, 5, 3], 2, p_min=0.1) == [7, 7]
    assert model.calls == [(7, 2, 0.1)]
    # The adaptive schedule sees that match among the proposals, to price beside the model draft.
    assert [(p.kind, p.tokens) for p in session.proposals([1, 2, 3, 9, 8, 5, 3], 2)] == [("lookup:prompt:1", [9, 8])]
    # A prediction's start (a match of 0: nothing written yet) is still drafted unpriced, before the model.
    predicted = HybridDrafter("hybrid", model).session(100)
    predicted.start(3, None, [40, 41, 42])
    assert predicted.propose([1, 2, 3], 2) == [40, 41] and len(model.calls) == 1
    # ... also where the own text has a match of its last token alone (1 followed 1 before), which it leaves aside.
    predicted = HybridDrafter("hybrid", model).session(100)
    predicted.start(3, None, [40, 41, 42])
    assert {p.kind for p in predicted.proposals([1, 2, 1], 2)} == {"lookup:prediction:0", "lookup:prompt:1"}
    assert predicted.propose([1, 2, 1], 2) == [40, 41] and len(model.calls) == 1
    assert session.lookups == 1


def test_hybrid_lookup_is_deterministic_under_sampling():
    model = _Recorder()
    session = HybridDrafter("hybrid", model).session(100)
    tokens, q = session.propose_sampled([4, 5, 6, 4, 5], 2, SamplingParams(0.8), None)
    assert (tokens, q) == ([6, 4], None)  # one-hot q, which rejection sampling takes as None
    tokens, q = session.propose_sampled([4, 5, 6, 1], 2, SamplingParams(0.8), None)
    assert (tokens, q) == ([7, 7], None)  # a model draft without sampling support proposes as under greedy


def _scan(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by scanning the whole sequence: the definition the indexed session must match."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        tail = ids[len(ids) - n :]
        starts = [s for s in range(len(ids) - n) if ids[s : s + n] == tail]
        if starts:
            return ids[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_session_index_follows_a_growing_sequence_and_a_replaced_one():
    rng = random.Random(3)
    for max_n, min_n in ((3, 1), (4, 2), (2, 2)):
        session = NgramDrafter(max_n=max_n, min_n=min_n).session(capacity=500)
        ids = [rng.randrange(5) for _ in range(3)]
        for step in range(150):
            k = rng.randrange(0, 5)
            expected = _scan(ids, k, max_n, min_n) if k > 0 and len(ids) >= 2 else []
            assert session.propose(ids, k) == expected
            if step % 37 == 36:  # the same session asked about another sequence: its index starts over
                ids = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
            else:
                ids = ids + [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        assert session.propose(tuple(ids), 2) == _scan(ids, 2, max_n, min_n)  # any sequence type


def test_a_capability_and_its_method_go_together():
    """A session or drafter that declares a capability without its method (or the reverse, as after a rename)
    fails when its class is defined, instead of quietly turning the feature off (trees becoming chains)."""
    import pytest

    with pytest.raises(TypeError, match="declares `trees` but does not define `propose_tree`"):

        class _NoTree(DraftSession):
            trees = True

            def propose(self, token_ids, k, p_min=0.0):
                return []

    with pytest.raises(TypeError, match="does not declare `trees` but defines `propose_tree`"):

        class _Undeclared(DraftSession):
            def propose(self, token_ids, k, p_min=0.0):
                return []

            def propose_tree(self, token_ids, shape):
                raise AssertionError

    with pytest.raises(TypeError, match="does not define `propose`"):

        class _Silent(DraftSession):
            pass

    with pytest.raises(TypeError, match="declares `batches` but does not define `propose_batch`"):

        class _NoBatch(Drafter):
            batches = True

            def session(self, capacity):
                raise AssertionError
