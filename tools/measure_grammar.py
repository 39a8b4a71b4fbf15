"""Time the grammar engines' token masks for the default target's vocabulary (not a test: a measurement).

For each engine found on the path (llguidance, xgrammar, outlines-core), a JSON schema is compiled, then a
valid answer is walked token by token: at every position the allowed-token mask is computed, then the token
consumed. Prints per engine: tokenizer set-up, compile, and the mean / worst mask time per token.

    python tools/measure_grammar.py            # what is installed in the environment
    PYTHONPATH=/tmp/gr_xgrammar python tools/measure_grammar.py   # an engine installed with pip --target
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from app import store
from app.engine.model.tokenizer import Tokenizer
from app.engine.model.weights import read_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "object", "properties": {"name": {"type": "string"}, "country": {"enum": ["FR", "DE", "IT"]}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "city", "tags", "score"],
}
ANSWER = {
    "name": "Marie Curie",
    "age": 66,
    "city": {"name": "Paris", "country": "FR"},
    "tags": ["physics", "chemistry", "radioactivity"],
    "score": 9.75,
}


def _answers() -> list[str]:
    """The answer's serialisations, most compact first: each engine's default whitespace takes one of them."""
    return [
        json.dumps(ANSWER, separators=(",", ":")),
        json.dumps(ANSWER),
        json.dumps(ANSWER, indent=2),
    ]


def _walk(ids: list[int], mask: Callable[[], object], consume: Callable[[int], bool]) -> list[float] | None:
    """Seconds of each mask computation along `ids`; None when the engine refuses one of them."""
    times = []
    for t in ids:
        t0 = time.perf_counter()
        mask()
        times.append(time.perf_counter() - t0)
        if not consume(t):
            return None
    return times


def llguidance_(tok: Tokenizer, vocab: int, eos: list[int]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for text in _answers():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        assert not m.is_error(), m.get_error()
        compile_s = time.perf_counter() - t0
        ids = tok.encode(text) + eos[:1]
        times = _walk(ids, lambda m=m: llguidance.torch.fill_next_token_bitmask(m, bitmask), m.consume_token)
        if times is not None:
            return setup, compile_s, times
    raise RuntimeError("llguidance refused every serialisation")


def xgrammar_(tok: Tokenizer, vocab: int, eos: list[int]) -> tuple[float, float, list[float]]:
    import xgrammar

    t0 = time.perf_counter()
    encoded = [tok.backend.id_to_token(i) or "" for i in range(vocab)]
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    for text in _answers():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_s = time.perf_counter() - t0
        m = xgrammar.GrammarMatcher(compiled)
        ids = tok.encode(text) + eos[:1]
        times = _walk(ids, lambda m=m: m.fill_next_token_bitmask(bitmask), m.accept_token)
        if times is not None:
            return setup, compile_s, times
    raise RuntimeError("xgrammar refused every serialisation")


def outlines_core_(tok: Tokenizer, vocab: int, eos: list[int]) -> tuple[float, float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # Byte-level BPE token strings back to their bytes (GPT-2's printable mapping of the 256 bytes).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    mapping: dict[bytes, list[int]] = {}
    for i in range(vocab):
        s = tok.backend.id_to_token(i)
        if s is None or i in eos or i in tok.special_ids:
            continue
        mapping.setdefault(bytes(to_byte[c] for c in s), []).append(i)
    v = Vocabulary(eos[0], mapping)
    setup = time.perf_counter() - t0
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    for text in _answers():
        t0 = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(SCHEMA)), v)
        compile_s = time.perf_counter() - t0
        g = Guide(index)
        ids = tok.encode(text)

        def consume(t: int, g: Guide = g) -> bool:
            try:
                g.advance(t)
            except ValueError:
                return False
            return True

        times = _walk(ids, lambda g=g: g.write_mask_into(mask.data_ptr(), mask.numel(), 4), consume)
        if times is not None:
            return setup, compile_s, times
    raise RuntimeError("outlines-core refused every serialisation")


def main() -> None:
    ckpt = read_checkpoint(store.resolve("smollm2-135m-instruct"), None)
    tok = Tokenizer.from_metadata(ckpt.tokenizer_meta, ckpt.config.eos_token_ids)
    vocab = ckpt.config.vocab_size
    eos = sorted(tok.eos_token_ids)
    print(f"vocabulary {vocab}, end tokens {eos}, torch threads {torch.get_num_threads()}")
    for name, run in (("llguidance", llguidance_), ("xgrammar", xgrammar_), ("outlines-core", outlines_core_)):
        try:
            setup, compile_s, times = run(tok, vocab, eos)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        # The first mask of a fresh matcher may build caches: reported apart from the steady state.
        rest = times[1:]
        print(
            f"{name}: tokenizer set-up {setup * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, "
            f"{len(times)} tokens: first mask {times[0] * 1e6:.0f} us, then mean {statistics.mean(rest) * 1e6:.0f} "
            f"us, median {statistics.median(rest) * 1e6:.0f} us, worst {max(rest) * 1e6:.0f} us"
        )
    # Applying a mask to a verification's rows (5: four drafts and the bonus row), the engine's way and torch's.
    from app.engine.decoding.grammar import mask_logits

    logits = torch.randn(5, vocab)
    allowed = torch.rand(5, vocab) > 0.5
    for name, apply in (
        ("torch.where (mask_logits)", lambda: mask_logits(logits, allowed)),
        ("torch masked_fill", lambda: logits.masked_fill(~allowed, float("-inf"))),
    ):
        apply()
        t0 = time.perf_counter()
        for _ in range(200):
            apply()
        print(f"applying 5 rows' masks, {name}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
