"""Speculative tree verification (app/engine/drafting/tree.py, the kernels' tree attention, the generation's tree
steps).

A tree row must get the very bits sequential decoding gives the same token at the same depth, the cache
compacted after acceptance must hold what sequential decoding writes, and the acceptance walk must keep the
longest path the target agrees with: checked on the real target per kernel, then on hand-made trees.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from app import store
from app.engine import generation, kernels
from app.engine.decoding.sampling import GumbelNoise, SamplingParams, gumbel_choice
from app.engine.drafting.draft_length import StepCosts
from app.engine.drafting.eagle import EagleDrafter, load_draft
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.tree import Candidates, DraftTree, accept, build_tree, compact, row_value, walk
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.model.cache import tree_depths
from app.engine.step import GenerationParams
from tests.conftest import FIXED_DRAFT

# Kernels whose attention takes trees (amx reads keys by slot: it keeps the chain).
TREE_KERNELS = [name for name in kernels.available() if kernels.SPECS[name].trees]

# Row 0 the root; a chain 1-2-3; siblings 4 (of the root) and 5 (of 1); a branch 6-7 below sibling 4, whose
# ancestors do not sit in consecutive slots.
PARENTS = [-1, 0, 1, 2, 0, 1, 4, 6]


def _path(parents: list[int], row: int) -> list[int]:
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    return path[::-1]


def test_tree_rows_and_compacted_cache_equal_sequential_decoding(packed_target):
    """On every tree kernel, each row of one tree forward equals, bit for bit, the row sequential decoding of
    its path computes; after `compact` the cache holds the path's keys and values where sequential decoding
    put them (every layer), so the steps after are unchanged."""
    torch.manual_seed(0)
    for name in TREE_KERNELS:
        model = packed_target(name).model
        assert model.kernel is not None and model.kernel.trees
        prompt = torch.randint(0, model.config.vocab_size, (37,))
        tokens = torch.randint(0, model.config.vocab_size, (len(PARENTS),))
        cache = model.new_cache(96)
        model.hidden(prompt[None], 0, cache)
        start = cache.length
        tree = model.hidden_batch([(tokens, start, cache, torch.tensor(PARENTS, dtype=torch.int32))])[0]
        assert cache.length == start + len(PARENTS)
        sequential = {}
        for row in range(len(PARENTS)):
            path = _path(PARENTS, row)
            alone = model.new_cache(96)
            model.hidden(prompt[None], 0, alone)
            for i, r in enumerate(path):
                h = model.hidden(tokens[r : r + 1][None], start + i, alone)[0, 0]
            assert torch.equal(h, tree[row]), (name, row)
            sequential[row] = alone
        # Accept the branch 4-6-7: its rows move to slots start+1..start+3.
        compact(cache, start, [4, 6, 7])
        assert cache.length == start + 4
        ref = sequential[7]
        assert torch.equal(cache.k[:, :, :, : start + 4], ref.k[:, :, :, : start + 4]), name
        assert torch.equal(cache.v[:, :, :, : start + 4], ref.v[:, :, :, : start + 4]), name


def test_tree_rows_take_an_explicit_mask_off_the_kernels(target_f32):
    """Where no kernel attends (float32 here, SDPA), a tree forward builds the ancestor mask: each row equals
    its path's sequential row within float32 rounding."""
    model = target_f32.model
    torch.manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (11,))
    tokens = torch.randint(0, model.config.vocab_size, (len(PARENTS),))
    cache = model.new_cache(40)
    model.hidden(prompt[None], 0, cache)
    tree = model.hidden_batch([(tokens, 11, cache, torch.tensor(PARENTS, dtype=torch.int32))])[0]
    for row in (3, 5, 7):
        path = _path(PARENTS, row)
        ids = torch.cat([prompt, tokens[path]])
        h = model.hidden(ids[None])[0, -1]
        assert torch.allclose(h, tree[row], atol=1e-4), row


def test_depths_and_bad_parents():
    assert tree_depths(PARENTS) == [0, 1, 2, 3, 1, 2, 2, 3]
    for bad in ([0, 0], [-1, 1], [-1, 0, 3]):
        try:
            tree_depths(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_build_tree_merges_the_branch_and_fills_with_the_best_siblings():
    chain = Candidates(
        [10, 11, 12],
        [0.5, 0.9, 0.8],
        [[(20, 0.3), (21, 0.1)], [(22, 0.05)], [(23, 0.15)]],
    )
    # The lookup agrees on 10, then goes 30, 31: one shared node, a branch of two.
    tree = build_tree(9, chain, [10, 30, 31], max_rows=16)
    assert tree.tokens[:4] == [9, 10, 11, 12] and tree.parents[:4] == [-1, 0, 1, 2]
    assert tree.tokens[4:6] == [30, 31] and tree.parents[4:6] == [1, 4]
    # Siblings by value: 20 (0.3), 21 (0.1), 23 (0.5*0.9*0.15 = 0.0675), 22 (0.5*0.05 = 0.025).
    assert tree.tokens[6:] == [20, 21, 23, 22] and tree.parents[6:] == [0, 0, 2, 1]
    assert tree.depths == [0, 1, 2, 3, 2, 3, 1, 1, 3, 2] and tree.depth == 3 and tree.nodes == 9
    # Rows run short: the branch first when asked (its rows in their sequential slots), the best sibling last.
    small = build_tree(9, chain, [10, 30, 31], max_rows=7, branch_first=True)
    assert small.tokens == [9, 10, 30, 31, 11, 12, 20] and small.parents == [-1, 0, 1, 2, 1, 4, 0]
    # A sibling the branch already holds is not added twice.
    dup = build_tree(9, chain, [20], max_rows=16)
    assert dup.tokens.count(20) == 1
    # Rows that cost: model nodes below the value floor are left out, the chain from its first such node on;
    # the lookup's branch stays.
    pruned = build_tree(9, chain, [10, 30, 31], max_rows=16, min_value=0.2)
    assert pruned.tokens == [9, 10, 11, 12, 30, 31, 20]
    pruned = build_tree(9, chain, [10, 30, 31], max_rows=16, min_value=0.4)
    assert pruned.tokens == [9, 10, 11, 30, 31] and pruned.parents == [-1, 0, 1, 1, 3]


def test_row_value_weighs_a_row_against_the_step():
    costs = StepCosts()
    assert row_value(costs, 2.0, 7) == 0.0  # nothing measured: the whole tree runs
    costs.observe(0, 0.0, 1, 0.025)
    costs.observe(0, 0.0, 16, 0.085)
    # 4 ms per row on a 7-row step of 49 ms that yields 2 tokens.
    assert abs(row_value(costs, 2.0, 7) - 0.004 / 0.049 * 2) < 1e-9
    flat = StepCosts()  # rows for free (AMX-like): every node pays
    flat.observe(0, 0.0, 1, 0.025)
    flat.observe(0, 0.0, 16, 0.025)
    assert row_value(flat, 2.0, 7) == 0.0


def test_walk_keeps_the_longest_agreeing_path():
    tree = DraftTree([9, 10, 11, 12, 20, 13, 21, 22], PARENTS, tree_depths(PARENTS))
    # The target says 20 after the root (a sibling), then 21, then 22, then 5: the branch 4-6-7, bonus 5.
    script = {0: 20, 4: 21, 6: 22, 7: 5}
    assert walk(tree, script.__getitem__) == ([4, 6, 7], 5)
    # The chain: 10, 11, then 99 (none of 2's children): two accepted, correction 99.
    script = {0: 10, 1: 11, 2: 99}
    assert walk(tree, script.__getitem__) == ([1, 2], 99)
    # 13 after 10: the sibling at depth 2, a leaf: its bonus comes next.
    script = {0: 10, 1: 13, 5: 7}
    assert walk(tree, script.__getitem__) == ([1, 5], 7)
    # Nothing agrees: the target's own token.
    assert walk(tree, lambda row: 3) == ([], 3)


def test_accept_greedy_and_gumbel_follow_the_target_choices():
    tree = DraftTree([9, 10, 11, 12, 20, 13, 21, 22], PARENTS, tree_depths(PARENTS))
    vocab = 32
    logits = torch.full((len(PARENTS), vocab), -5.0)
    for row, tok in {0: 20, 4: 21, 6: 22, 7: 4, 1: 3, 2: 1, 3: 2, 5: 0}.items():
        logits[row, tok] = 5.0
    assert accept(tree, logits, SamplingParams(), None, 100) == ([4, 6, 7], 4)
    # Sampled: each visited row draws at the position its depth predicts, as target-only sampling does there.
    params = SamplingParams(temperature=1.0)
    noise = GumbelNoise(7, vocab)
    torch.manual_seed(3)
    logits = torch.randn(len(PARENTS), vocab)
    for row, tok in {0: 20, 4: 21, 6: 22}.items():
        logits[row, tok] += 6.0  # likely, not certain: the noise decides
    path, nxt = accept(tree, logits, params, noise, 100)
    assert path == [4, 6, 7]
    row = 0
    for i, r in enumerate(path):
        assert gumbel_choice(logits[row], params, noise, 100 + i) == tree.tokens[r]
        row = r
    assert gumbel_choice(logits[row], params, noise, 100 + len(path)) == nxt


# --- the generation's tree steps --------------------------------------------------------------------------


def _prompts(tokenizer, turns: list[str]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in turns]


def _hybrid(model, loaded) -> HybridDrafter:
    draft = load_draft(store.resolve("smollm2-135m-instruct-eagle"), model)
    return HybridDrafter("hybrid", EagleDrafter("eagle", draft, loaded))


def _run(engine: Engine, prompt: list[int], params: GenerationParams, draft: str) -> Generation:
    gen = engine.start(prompt, params, draft)
    while not gen.finished:
        gen.step()
    return gen


def test_tree_speculative_equals_target_only_greedy_and_seeded(packed_target, target_f32, first_turns, monkeypatch):
    """Greedy tree verification with the default (hybrid) draft gives target-only's tokens, on every tree
    kernel, alone and batched; so does gumbel sampling with a seed. Paths off the draft's chain were accepted
    (their keys and values moved), and the tree keeps more tokens per target pass than the chain."""
    moved = []

    def counting(cache, start, path):
        moved.append(path != list(range(1, len(path) + 1)))
        compact(cache, start, path)

    monkeypatch.setattr(generation, "compact", counting)
    # Whole trees: how far a tree is pruned depends on measured times, and the pass counts below should not.
    monkeypatch.setattr(generation, "row_value", lambda *args: 0.0)
    prompts = _prompts(target_f32.tokenizer, first_turns)
    greedy = GenerationParams(max_new_tokens=32, num_draft_tokens=6)
    sampled = GenerationParams(max_new_tokens=16, num_draft_tokens=6, temperature=0.8, top_p=0.95, seed=11)
    for name in TREE_KERNELS:
        packed = packed_target(name)
        drafter = _hybrid(packed.model, packed)
        engine = Engine(
            packed.model,
            packed.tokenizer,
            {"hybrid": drafter},
            "hybrid",
            6,
            tree_rows=16,
            **FIXED_DRAFT,
        )
        best = name == TREE_KERNELS[0]  # the others compute the same bits (test_kernels): one prompt, greedy
        passes = {"chain": 0, "tree": 0}
        bases = []
        for prompt in prompts[: 2 if best else 1]:
            base = _run(engine, prompt, greedy, "none").generated_ids
            bases.append(base)
            for label, rows in (("chain", 0), ("tree", 16)) if best else (("tree", 16),):
                gen = _run(engine, prompt, replace(greedy, tree_rows=rows), "hybrid")
                assert gen.generated_ids == base, (name, label)
                assert gen.tree_rows == rows
                passes[label] += gen.stats.target_passes
        if best:
            assert passes["tree"] < passes["chain"], passes
            seeded = _run(engine, prompts[0], sampled, "none").generated_ids
            assert _run(engine, prompts[0], sampled, "hybrid").generated_ids == seeded
            # Batched, beside each other: alone's tokens, greedy and seeded.
            asked = ((prompts[0], greedy), (prompts[1], greedy), (prompts[0], sampled))
            gens = [engine.start(prompt, params, "hybrid") for prompt, params in asked]
            while not all(gen.finished for gen in gens):
                running = [gen for gen in gens if not gen.finished]
                step = engine.step_batch(running)
                assert not any(isinstance(out, Exception) for out in step), list(step)
            assert [gen.generated_ids for gen in gens] == [*bases, seeded]
            assert all(gen.tree_rows == 16 for gen in gens)
    assert any(moved)
