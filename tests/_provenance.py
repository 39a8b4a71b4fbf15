"""What every stream's `provenance` must satisfy, for the API tests and the browser tests.

Test modules import it as `_provenance` (pytest puts tests/ on sys.path: the directory has no __init__.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

DRAFTED = {"draft", "lookup", "forced"}
TARGETS = {"target", "correction", "bonus"}


def check_provenance(
    tokens: list[dict[str, Any]], passes: list[dict[str, Any]], speculative: dict[str, Any], grammar: bool = False
) -> None:
    """The tokens' sources agree with their passes' figures, and the passes with the request's totals: each pass
    keeps its accepted drafts (and the tokens a grammar forced among them), then adds one token of its own. With a
    `grammar`, drafts it refused before verification count as rejected without being in `drafted`."""
    assert [p["pass"] for p in passes] == list(range(1, len(passes) + 1))
    assert len(passes) == speculative["target_passes"]
    assert sum(p["accepted"] for p in passes) == speculative["accepted"]
    assert passes[0]["drafted"] == passes[0]["accepted"] == 0  # the prefill's pass
    by_pass: dict[int, list[str]] = defaultdict(list)
    for t in tokens:
        by_pass[t["pass"]].append(t["source"])
        assert isinstance(t["logprob"], float) and t["logprob"] <= 0
    assert sorted(by_pass) == [p["pass"] for p in passes if p["pass"] in by_pass]
    last = len(passes)
    for p in passes:
        sources = by_pass[p["pass"]]
        kept = [s for s in sources if s in DRAFTED]
        accepted = len([s for s in kept if s != "forced"])
        if p["pass"] == last:  # the generation may end inside the last pass's tokens
            assert accepted <= p["accepted"]
            continue
        assert accepted == p["accepted"] and sources[: len(kept)] == kept, p
        assert len(sources) == len(kept) + 1 and sources[-1] in TARGETS, p
        if p["drafted"] == 0:
            expected = {"target", "correction"} if grammar else {"target"}
        elif p["accepted"] == p["drafted"]:
            expected = {"bonus", "correction"} if grammar else {"bonus"}
        else:
            expected = {"correction"}
        assert sources[-1] in expected, p
