"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex, a choice of strings) that says which
tokens may come next, computed by llguidance.

A request's `GrammarState` gives the allowed-token masks of a whole verification at once: row i after the
accepted text plus the first i drafts, advancing through the drafts tentatively and rolling them back, so the
target's verification masks every row as target-only decoding would have masked that position. The accepted
tokens are then consumed for good. Once the grammar is complete only an end-of-sequence token is allowed.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.engine.model.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice")

# Deepest a JSON schema may nest (objects and arrays): llguidance's JSON reader stops at 128 levels, and
# Python's own recursive helpers (json.dumps) at about a thousand; a clear refusal comes first.
MAX_SCHEMA_DEPTH = 100
# Most strings of a choice and branches of a schema's anyOf or oneOf: llguidance's parser holds at most 2,000
# live alternatives at a position, and compiling many more takes minutes (100,000 choices: 168 s, then a panic).
MAX_ALTERNATIVES = 2000
# Tokens a grammar is walked through when it is checked (each time the shortest token it allows): llguidance's
# parser refuses, at its first tokens, a position with more than 2,000 live alternatives (a choice of 2,500
# strings, an anyOf of 3,000 objects, an object of 500 optional properties), which compiling does not find.
PROBE_TOKENS = 16


# llguidance's limits, its defaults but for the error messages: verbose ones carry the whole grammar and the
# parser's state (hundreds of kilobytes for a large schema), which must reach neither a client nor the log.
@functools.cache
def _limits() -> Any:
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def json_depth(value: object) -> int:
    """How deep `value` (parsed JSON) nests: 0 for a scalar, 1 for a flat list or object; without recursion, so
    that any depth can be measured."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _widest_branching(schema: object) -> tuple[str, int]:
    """The longest anyOf or oneOf list of a schema (its keyword and length), found without recursion."""
    widest = ("", 0)
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key in ("anyOf", "oneOf"):
                branches = item.get(key)
                if isinstance(branches, list) and len(branches) > widest[1]:
                    widest = (key, len(branches))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return widest


def _short(message: str, limit: int = 300) -> str:
    """llguidance's message on one line and cut: the first lines name the problem, the rest is its context."""
    text = " ".join(line.strip() for line in message.replace("<non-verbose/>", "").splitlines() if line.strip())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to, as plain text (the API layer knows nothing else).

    `kind`: "json_schema" (`spec`: the schema as JSON text), "json_object" (any JSON object; `spec` unused),
    "regex" (`spec`: the pattern, matched whole) or "choice" (`spec`: a JSON array of the strings allowed).

    `compiled`: the matcher `Grammars.check` built, opaque to the caller; it goes with the request to the worker,
    whose `Grammars.start` copies it instead of compiling the grammar again (None: `start` compiles it)."""

    kind: str
    spec: str = ""
    compiled: Any = field(default=None, compare=False, repr=False)


class Grammars:
    """Compiles grammar specs against one tokenizer and starts per-request states. Thread-safe: the HTTP
    threads check a request's grammar before it is queued, the worker starts its state. llguidance and its
    view of the vocabulary (a third of a second to build) are loaded at the first grammar, not before."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._shortest_first: np.ndarray | None = None  # token ids, shortest text first (the probe's order)

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                # The tokenizer's own JSON: llguidance reads its byte-level vocabulary and merges from it.
                self._lltok = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids),
                )
            return self._lltok

    def _text(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for `spec`, unchecked; raises GrammarError."""
        try:
            return self._grammar(spec)
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError) as exc:  # what llguidance raises on input it cannot read
            raise GrammarError(_short(str(exc))) from exc

    @staticmethod
    def _grammar(spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the schema is not JSON: {exc}") from exc
            except RecursionError as exc:
                raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from exc
            if not isinstance(schema, dict):
                raise GrammarError("the schema must be a JSON object")
            if (depth := json_depth(schema)) > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"the schema nests {depth} levels deep, over the limit of {MAX_SCHEMA_DEPTH}")
            keyword, width = _widest_branching(schema)
            if width > MAX_ALTERNATIVES:
                raise GrammarError(f"an {keyword} of {width} schemas, over the limit of {MAX_ALTERNATIVES}")
            grammar = LLMatcher.grammar_from_json_schema(schema)
        elif spec.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.spec)
        elif spec.kind == "choice":
            try:
                choices = json.loads(spec.spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the choices are not JSON: {exc}") from exc
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("the choices must be a non-empty list of non-empty strings")
            if len(choices) > MAX_ALTERNATIVES:
                raise GrammarError(f"{len(choices)} choices, over the limit of {MAX_ALTERNATIVES}")
            # Lark's string literals take JSON's escapes.
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        else:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, not {spec.kind!r}")
        return grammar

    def check(self, spec: GrammarSpec) -> GrammarSpec:
        """`spec` with its compiled matcher (`GrammarSpec.compiled`); raise GrammarError when it cannot be
        compiled, or cannot run its first `PROBE_TOKENS` tokens.

        The matcher travels with the request rather than in a cache here: the worker, which runs every request's
        steps, then never compiles a grammar a second time (a large one takes a second), however many requests
        wait between the check and their start."""
        matcher = self._matcher(self._text(spec))
        self._probe(matcher.deep_copy())
        return replace(spec, compiled=matcher)

    def _matcher(self, grammar: str) -> Any:
        """A matcher of `grammar` (llguidance's text; its constructor checks it as `validate_grammar` would)."""
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0, limits=_limits())
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(_short(str(exc))) from exc
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher

    def _probe(self, matcher: Any) -> None:
        """Walk `matcher` through up to PROBE_TOKENS tokens, each the shortest it allows: short tokens keep the
        most alternatives alive, where llguidance's parser meets its limits. Raises GrammarError there."""
        order = self._probe_order()
        words = (self.vocab_size + 31) // 32
        bits = np.empty(words, dtype=np.int32)
        eos = self.tokenizer.eos_token_ids
        for _ in range(PROBE_TOKENS):
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
            if matcher.is_error():
                break
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(np.bool_)
            token = next((int(t) for t in order[allowed[order]] if int(t) not in eos), None)
            if token is None or not matcher.consume_token(token):
                break  # complete (only an end-of-sequence token is left), or refused: is_error says which
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot run: {_short(matcher.get_error())}")

    def _probe_order(self) -> np.ndarray:
        with self._lock:
            if self._shortest_first is None:
                lengths = np.full(self.vocab_size, np.iinfo(np.int32).max, dtype=np.int64)
                for text, token in self.tokenizer.backend.get_vocab().items():
                    if 0 <= token < self.vocab_size:
                        lengths[token] = len(text)
                self._shortest_first = np.argsort(lengths, kind="stable")
            return self._shortest_first

    def start(self, spec: GrammarSpec, forcing: bool = True) -> GrammarState:
        """A fresh state of `spec` for one request (`forcing`: see GrammarState), from its compiled matcher when
        `check` made one (each state a copy: the n choices of a request share one spec); raises GrammarError."""
        matcher = spec.compiled.deep_copy() if spec.compiled is not None else self._matcher(self._text(spec))
        return GrammarState(matcher, self.vocab_size, forcing, self.tokenizer.eos_token_ids)


class GrammarState:
    """One request's position in its grammar: the masks of the next positions, advanced by accepted tokens.

    Drafting and verification move the matcher past the accepted text tentatively (`_path`), through the
    tokens of the step at hand, and keep the masks computed on the way, so a mask the draft computed for a
    position serves the verification of that position too. `accept` commits tokens; everything else leaves
    the accepted text as it was.

    `forcing`: whether tokens the grammar forces (the only token its mask allows) are proposed as they are,
    without a draft's guess and free of the draft length (`forced_tokens`, `forced`)."""

    def __init__(
        self, matcher: Any, vocab_size: int, forcing: bool = True, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32
        self.forcing = forcing
        self._path: list[int] = []  # tokens consumed past the accepted text, for the step at hand
        # _bits[i]: the packed mask [words] after the accepted text plus _path[:i], None until computed.
        self._bits: list[np.ndarray | None] = [None]

    def _goto(self, tokens: Sequence[int]) -> int:
        """Move the matcher to the accepted text plus tokens[:n], n the most the grammar allows in a row; n."""
        path = self._path
        p = 0
        limit = min(len(path), len(tokens))
        while p < limit and path[p] == tokens[p]:
            p += 1
        if p < len(path):
            # An end-of-sequence token is never consumed by the matcher (see _consume_path): not rolled back either.
            back = sum(t not in self._eos for t in path[p:])
            if back and not self._matcher.rollback(back):
                raise RuntimeError(f"the grammar could not roll back: {self._matcher.get_error()}")
            del path[p:]
            del self._bits[p + 1 :]
        if p == len(tokens):
            return p
        # Each token is checked against the mask at its position (the very masks verification uses) before it is
        # consumed: a refused one would leave the matcher in its error state. (llguidance 1.9.1's validate_tokens
        # disagrees with its masks where the grammar is complete: it takes neither an end-of-sequence token nor
        # trailing whitespace that the mask allows.) Nothing follows an end-of-sequence token.
        for t in tokens[p:]:
            if self._ended or not (int(self._packed()[t >> 5]) >> (t & 31)) & 1:
                break
            self._consume_path([t])
        return len(path)

    @property
    def _ended(self) -> bool:
        """Whether the matcher stands after an end-of-sequence token (drafted: the accepted text never has one)."""
        return bool(self._path) and self._path[-1] in self._eos

    def _consume_path(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # llguidance takes an end-of-sequence token without counting it in what rollback undoes, so it stays
            # on the path alone (the masks after it allow end-of-sequence tokens only).
            if t not in self._eos:
                self._consume(t)
            self._path.append(t)
            self._bits.append(None)

    def _packed(self) -> np.ndarray:
        """The packed mask after the matcher's position (the accepted text plus `_path`), computed once."""
        i = len(self._path)
        bits = self._bits[i]
        if bits is None:
            bits = np.empty(self._words, dtype=np.int32)
            if self._ended:
                # After an end-of-sequence token (a verification row nothing will be kept from): those alone.
                bits[:] = 0
                for t in self._eos:
                    bits[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(2**31))
            else:
                self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, self._words * 4)
            self._bits[i] = bits
        return bits

    def _unpack(self, bits: np.ndarray) -> Tensor:
        # Bit j of word w allows token 32 w + j (little-endian within each int32, as llguidance writes them).
        unpacked = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[..., : self._vocab]
        return torch.from_numpy(unpacked.view(np.bool_))

    @staticmethod
    def _single(bits: np.ndarray) -> int | None:
        """The one token a packed mask allows, None when it allows none or several."""
        words = np.flatnonzero(bits)
        if len(words) != 1:
            return None
        w = int(words[0])
        word = int(bits[w]) & 0xFFFFFFFF
        return None if word & (word - 1) else 32 * w + word.bit_length() - 1

    def masks(self, drafts: Sequence[int] = ()) -> tuple[Tensor, int]:
        """(allowed bool [n + 1, V], n): n is how many of `drafts` the grammar accepts in a row, and row i the
        tokens allowed after the accepted text plus drafts[:i]. The accepted text stays as it was."""
        n = self._goto(drafts)
        return self._unpack(np.stack(self._rows(drafts, n))), n

    def _rows(self, tokens: Sequence[int], n: int) -> list[np.ndarray]:
        """The packed masks after the accepted text plus tokens[:i], i = 0..n (tokens[:n] allowed in a row),
        computing those not kept; leaves the matcher after tokens[:n]."""
        self._goto(tokens[:n])
        missing = next((i for i in range(n + 1) if self._bits[i] is None), None)
        if missing is not None:
            # Back to the first row not computed (the rows after it are dropped), then forward row by row.
            for i in range(missing, n + 1):
                self._goto(tokens[:i])
                self._packed()
        return [bits for bits in self._bits[: n + 1] if bits is not None]

    def allowed(self, drafted: Sequence[int] = ()) -> Tensor | None:
        """Tokens allowed (bool [V]) after the accepted text plus `drafted`; None when the grammar refuses
        `drafted` itself or it ends with an end-of-sequence token (nothing comes after one)."""
        if self._goto(drafted) < len(drafted) or self._ended:
            return None
        return self._unpack(self._packed())

    def forced(self, drafted: Sequence[int] = ()) -> int | None:
        """With `forcing`, the token the grammar forces after the accepted text plus `drafted` (the only one
        its mask allows); else, or when it allows several (or refuses `drafted`), None."""
        if not self.forcing or self._goto(drafted) < len(drafted) or self._ended:
            return None
        return self._single(self._packed())

    def forced_tokens(self, drafted: Sequence[int], limit: int) -> list[int]:
        """With `forcing`, the tokens the grammar forces in a row after the accepted text plus `drafted`, at
        most `limit` (none past an end-of-sequence token: nothing comes after one)."""
        out: list[int] = []
        path = list(drafted)
        while len(out) < limit:
            token = self.forced(path)
            if token is None:
                break
            out.append(token)
            path.append(token)
        return out

    def forced_flags(self, drafts: Sequence[int]) -> list[bool]:
        """Per draft (all of them allowed in a row), whether the grammar allowed it alone there: a forced
        token, which the target's masked choice is whatever its logits."""
        # The row after the last draft too: the verification masks with it.
        rows = self._rows(drafts, len(drafts))
        return [self._single(bits) == token for bits, token in zip(rows, drafts, strict=False)]

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, in a row from the first, the grammar allows after the accepted text."""
        return self._goto(drafts)

    def accept(self, tokens: Sequence[int]) -> None:
        """Consume tokens appended to the accepted text (each one a mask allowed)."""
        if self._goto(tokens) < len(tokens):
            raise RuntimeError(f"the grammar refused a token of {list(tokens)}")
        # The masks after the new accepted text stay: row 0 is the one after all of them.
        del self._bits[: len(tokens)]
        self._path.clear()

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar is satisfied after the accepted text: an end-of-sequence token may come next."""
        self._goto(())
        return bool(self._matcher.is_accepting())


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """`logits` [rows, V] with the tokens `allowed` [rows, V] (bool) does not hold set to -inf (a new tensor)."""
    # torch.where over a 0-d -inf: the quickest of masked_fill, numpy's where and an added bias here
    # (tools/measure_grammar.py times it beside masked_fill).
    return torch.where(allowed.to(logits.device), logits, torch.tensor(float("-inf"), device=logits.device))
