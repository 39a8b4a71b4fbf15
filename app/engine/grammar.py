"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regex, a choice of strings) that says which
tokens may come next, computed by llguidance.

A request's `GrammarState` gives the allowed-token masks of a whole verification at once: row i after the
accepted text plus the first i drafts, advancing through the drafts tentatively and rolling them back, so the
target's verification masks every row as target-only decoding would have masked that position. The accepted
tokens are then consumed for good. Once the grammar is complete only an end-of-sequence token is allowed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.engine.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to, as plain text (the API layer knows nothing else).

    `kind`: "json_schema" (`spec`: the schema as JSON text), "json_object" (any JSON object; `spec` unused),
    "regex" (`spec`: the pattern, matched whole) or "choice" (`spec`: a JSON array of the strings allowed)."""

    kind: str
    spec: str = ""


class Grammars:
    """Compiles grammar specs against one tokenizer and starts per-request states. Thread-safe: the HTTP
    threads check a request's grammar before it is queued, the worker starts its state. llguidance and its
    view of the vocabulary (a third of a second to build) are loaded at the first grammar, not before."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltok: Any = None

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

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for `spec`, checked against the vocabulary; raises GrammarError."""
        from llguidance import LLMatcher

        try:
            grammar = self._grammar(spec)
            error = LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        except (ValueError, TypeError, RuntimeError) as exc:  # what llguidance raises on input it cannot read
            raise GrammarError(str(exc)) from exc
        if error:
            raise GrammarError(error.strip())
        return grammar

    @staticmethod
    def _grammar(spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the schema is not JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise GrammarError("the schema must be a JSON object")
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
            # Lark's string literals take JSON's escapes.
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        else:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, not {spec.kind!r}")
        return grammar

    def check(self, spec: GrammarSpec) -> None:
        """Raise GrammarError when `spec` cannot be compiled."""
        self.compile(spec)

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state of `spec` for one request; raises GrammarError."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """One request's position in its grammar: the masks of the next positions, advanced by accepted tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32

    def masks(self, drafts: Sequence[int] = ()) -> tuple[Tensor, int]:
        """(allowed bool [n + 1, V], n): n is how many of `drafts` the grammar accepts in a row, and row i the
        tokens allowed after the accepted text plus drafts[:i]. The state is left as it was."""
        n = self.valid_prefix(drafts) if drafts else 0
        bits = torch.empty((n + 1, self._words), dtype=torch.int32)
        for i in range(n + 1):
            if i:
                self._consume(drafts[i - 1])
            self._matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), self._words * 4)
        if n and not self._matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")
        # Bit j of word w allows token 32 w + j (little-endian within each int32, as llguidance writes them).
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")[:, : self._vocab]
        return torch.from_numpy(unpacked.view(np.bool_)), n

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, in a row from the first, the grammar allows after the accepted text."""
        return int(self._matcher.validate_tokens(list(drafts)))

    def accept(self, tokens: Sequence[int]) -> None:
        """Consume tokens appended to the accepted text (each one a mask allowed)."""
        for t in tokens:
            self._consume(t)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar is satisfied: an end-of-sequence token may come next."""
        return bool(self._matcher.is_accepting())


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """`logits` [rows, V] with the tokens `allowed` [rows, V] (bool) does not hold set to -inf (a new tensor)."""
    # torch.where over a 0-d -inf: the quickest of masked_fill, numpy's where and an added bias here
    # (tests/_measure_grammar.py times it beside masked_fill).
    return torch.where(allowed.to(logits.device), logits, torch.tensor(float("-inf"), device=logits.device))
