"""The built-in drafters by name: one entry each (what it is, the settings it reads, how it is built), which the
engine's factory, the command line and the API's descriptions read, so that a new drafter is its own module and
one `register` call here (vLLM's spec_decode proposers, each in its file).

Model drafts (a small decoder, a trained feature draft) are not entries: they are loaded by the name or path the
user gives (app.engine.factory) and then passed to the entries that build on one (`needs_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.engine.drafting.base import Drafter
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.drafting.suffix import SuffixDrafter
from app.engine.drafting.suffix_index import TrafficIndex


@dataclass(frozen=True)
class DraftContext:
    """What an entry may build on: the loaded model draft (None: none) and the engine's index of earlier answers
    (None: none kept)."""

    model: Drafter | None
    traffic: TrafficIndex | None


@dataclass(frozen=True)
class DrafterEntry:
    """A built-in drafter: its `description` (the API's schema shows it); `build` makes it;
    `needs_model`: it drafts with the loaded model draft too, so exists only beside one."""

    name: str
    description: str
    build: Callable[[DraftContext], Drafter]
    needs_model: bool = False


REGISTRY: dict[str, DrafterEntry] = {}


def register(entry: DrafterEntry) -> None:
    """Add a built-in drafter (a name taken twice is a programming error)."""
    if entry.name in REGISTRY or entry.name in ("none", "default"):
        raise ValueError(f"drafter name {entry.name!r} is taken")
    REGISTRY[entry.name] = entry


def _hybrid(ctx: DraftContext) -> Drafter:
    assert ctx.model is not None  # needs_model
    return HybridDrafter("hybrid", ctx.model, ctx.traffic)


register(
    DrafterEntry(
        "ngram",
        "prompt lookup alone: what followed the latest earlier occurrence of the last 1-3 tokens in the request",
        lambda ctx: NgramDrafter(),
    )
)
register(
    DrafterEntry(
        "suffix",
        "lookups in the request's own text, its `prediction` and the tenant's earlier answers, each priced by its "
        "match length (no model draft)",
        lambda ctx: SuffixDrafter("suffix", ctx.traffic),
    )
)
register(
    DrafterEntry(
        "hybrid",
        "the suffix draft's lookups where they are worth most, the loaded model draft elsewhere (the default)",
        _hybrid,
        needs_model=True,
    )
)


def builtin(ctx: DraftContext) -> dict[str, Drafter]:
    """Every entry that can be built in `ctx` (those that need a model draft only with one), by name."""
    return {name: e.build(ctx) for name, e in REGISTRY.items() if ctx.model is not None or not e.needs_model}


def lookup_names() -> list[str]:
    """The entries that need no model draft: every target has them."""
    return [name for name, e in REGISTRY.items() if not e.needs_model]
