"""Tenants: who may read what earlier requests left in the prefix cache and the index of earlier answers.

A request's tenant is its API key's (several keys, each named: `api_keys`, `api_key_file`), refined by its
`cache_salt` within that key, so one key's requests never draft from, nor find cached, what another key's wrote,
whatever salt they send. Without keys unsalted requests share one tenant, unless `isolation` is `strict`: then
each is a tenant of its own. A salt is a secret with a minimum length; the native routes take it at the top level
too (as vLLM's clients send it).
"""

from __future__ import annotations

import json
import logging

import pytest

from app.api.schemas import MIN_CACHE_SALT
from app.engine import kernels
from app.engine.drafting.suffix import SuffixDrafter
from app.engine.drafting.suffix_index import TrafficIndex
from app.engine.engine import Engine
from app.service.settings import Settings
from tests.conftest import FIXED_DRAFT
from tools import digit_probe

pytestmark = pytest.mark.anyio

KEY_A = "alice-key-0123456789abcdef"
KEY_B = "bob-key-0123456789abcdefgh"
KEYS = f"alice:{KEY_A},bob:{KEY_B}"
SALT = "shared-salt-0123456789"
# A prompt that makes the model repeat a code: the answer a probe would want to read back.
PROMPT = "Repeat after me: the verification code is 4 8 1 5 9 2. Repeat after me: the verification code is"
PROBE = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "speculative": {"draft": "suffix"}}


@pytest.fixture
def suffix_engine(packed_target) -> Engine:
    """An engine whose draft is the lookups alone (so every index hit shows in `draft_sources`), with an index and,
    served, a prefix cache of its own."""
    packed = packed_target(kernels.available()[0])
    traffic = TrafficIndex(1 << 22)
    drafts = {"suffix": SuffixDrafter("suffix", traffic)}
    return Engine(packed.model, packed.tokenizer, drafts, "suffix", 4, traffic=traffic, **FIXED_DRAFT)


def _tiny_suffix_engine(make_tiny_model, tokenizer) -> Engine:
    """A tiny random target over bytes whose draft is the lookups alone, with an empty index: fast to probe 60
    times, and a regex makes it write any answer (the victim's code, the probes' guesses)."""
    traffic = TrafficIndex(1 << 20)
    drafts = {"suffix": SuffixDrafter("suffix", traffic)}
    model = make_tiny_model(0, vocab_size=tokenizer.vocab_size)
    return Engine(model, tokenizer, drafts, "suffix", 4, traffic=traffic, **FIXED_DRAFT)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _probe(client, headers: dict[str, str] | None = None, **fields) -> tuple[int, int, str]:
    """(tokens drafted from the index, prompt tokens found cached, text) of the probe."""
    r = await client.post("/v1/completions", json={**PROBE, **fields}, headers=headers or {})
    assert r.status_code == 200, r.text
    body = r.json()
    index = body["speculative"]["draft_sources"].get("index", 0)
    return index, body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]


async def test_one_key_reads_nothing_another_key_wrote(suffix_engine, api_client) -> None:
    """Key A's repeat drafts from its first answer and finds its prompt cached (the probe is informative); key B
    sending the very same request, unsalted or with A's salt, drafts nothing from A's answer and finds nothing
    cached: its figures are those of a cold server."""
    async with api_client(suffix_engine, api_keys=KEYS) as c:
        for fields in ({}, {"cache_salt": SALT}):
            first = await _probe(c, _auth(KEY_A), **fields)
            again = await _probe(c, _auth(KEY_A), **fields)
            other = await _probe(c, _auth(KEY_B), **fields)
            assert first[:2] == (0, 0)
            assert again[0] > 0 and again[1] > 0, fields  # within a key: the earlier answer and prompt, reused
            assert other[:2] == (0, 0), fields  # across keys: nothing, whatever salt was sent
            assert other[2] == again[2] == first[2]  # only the speed differs, never the text
        # Streamed with provenance: no token of B's came from the index either.
        r = await c.post(
            "/v1/completions", json={**PROBE, "stream": True, "provenance": True, "cache_salt": "b-" + SALT}
        )
        assert r.status_code == 401  # and without a key, nothing at all
        r = await c.post(
            "/v1/completions",
            json={**PROBE, "stream": True, "provenance": True, "cache_salt": "b-" + SALT},
            headers=_auth(KEY_B),
        )
        assert '"source":"index"' not in r.text and '"source":"' in r.text
        metrics = (await c.get("/metrics", headers=_auth(KEY_A))).text
    counted = [line for line in metrics.splitlines() if line.startswith("specserve_api_key_requests_total{")]
    assert any('key="alice"' in line for line in counted) and any('key="bob"' in line for line in counted)
    assert KEY_A not in metrics and KEY_B not in metrics


async def test_without_keys_unsalted_requests_share_unless_isolation_is_strict(
    suffix_engine, api_client, caplog
) -> None:
    """Sharing is the keyless default, and said at start-up; `isolation: strict` makes each unsalted request a
    tenant of its own (nothing reused, nothing kept for the next), while a salt still names a tenant."""
    with caplog.at_level(logging.INFO, logger="app.api.server"):
        async with api_client(suffix_engine) as c:
            await _probe(c)
            shared = await _probe(c)
    assert shared[0] > 0 and shared[1] > 0
    assert "share one tenant" in caplog.text

    # The same engine, its caches as the shared server left them: strict reads none of it.
    async with api_client(suffix_engine, isolation="strict") as c:
        first = await _probe(c, max_tokens=20)
        again = await _probe(c, max_tokens=20)
        assert first[:2] == again[:2] == (0, 0)
        salted = "strict-" + SALT
        await _probe(c, cache_salt=salted)
        within = await _probe(c, cache_salt=salted)
    assert within[0] > 0 and within[1] > 0
    assert again[2] == first[2]


async def test_salts_are_secrets_of_a_minimum_length_and_the_native_top_level_one_counts(
    suffix_engine, api_client, sse_data
) -> None:
    short = "x" * (MIN_CACHE_SALT - 1)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "cache_salt": short}
    gen = {"inputs": PROMPT, "parameters": {"max_new_tokens": 24, "details": True, "speculative": {"draft": "suffix"}}}
    async with api_client(suffix_engine) as c:
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "cache_salt" in r.text and str(MIN_CACHE_SALT) in r.text, r.text
        r = await c.post("/v1/completions", json={**PROBE, "cache_salt": short})
        assert r.status_code == 400 and "cache_salt" in r.text
        for body in ({**gen, "cache_salt": short}, {**gen, "parameters": {**gen["parameters"], "cache_salt": short}}):
            r = await c.post("/generate", json=body)
            assert r.status_code == 422 and "cache_salt" in r.text, r.text
        r = await c.post("/generate", json={**gen, "cache_salt": SALT, "parameters": {"cache_salt": "other-" + SALT}})
        assert r.status_code == 422 and "cache_salt" in r.text

        # The top-level salt is the request's tenant: the same as parameters.cache_salt, not the shared one.
        def index_hits(r) -> int:
            assert r.status_code == 200, r.text
            return r.json()["details"]["speculative"]["draft_sources"].get("index", 0)

        assert index_hits(await c.post("/generate", json={**gen, "cache_salt": SALT})) == 0
        assert index_hits(await c.post("/generate", json=gen)) == 0  # the shared tenant: nothing of the salt's
        inner = {**gen, "parameters": {**gen["parameters"], "cache_salt": SALT}}
        assert index_hits(await c.post("/generate", json=inner)) > 0
        r = await c.post("/generate_stream", json={**gen, "cache_salt": SALT})
        last = json.loads(sse_data(r.text)[-1])
        assert last["details"]["speculative"]["draft_sources"].get("index", 0) > 0


def test_named_keys_from_the_variable_the_file_and_api_key(tmp_path, monkeypatch) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\ncarol:carol-key-0123456789\n\ndave:dave-key-0123456789\n")
    monkeypatch.setenv("SPECSERVE_API_KEYS", KEYS)
    s = Settings(api_key="the-default-key-0123", api_key_file=str(keyfile))
    assert s.named_api_keys == {
        "default": "the-default-key-0123",
        "alice": KEY_A,
        "bob": KEY_B,
        "carol": "carol-key-0123456789",
        "dave": "dave-key-0123456789",
    }
    monkeypatch.delenv("SPECSERVE_API_KEYS")
    for bad, said in (
        ("alice", "name:key"),
        ("a|b:key-0123", "name:key"),
        ("alice:has space", "printable"),
        ("a:same-key-0123,b:same-key-0123", "same key"),
        ("a:key-one-0123,a:key-two-0123", "given twice"),
    ):
        with pytest.raises(ValueError, match=said) as caught:
            Settings(api_keys=bad)
        assert "0123" not in str(caught.value).split("input_value")[0]  # the message never quotes a key
    keyfile.write_text("carol:carol-key\nbroken line\n")
    with pytest.raises(ValueError, match="line 2"):
        Settings(api_key_file=str(keyfile))
    with pytest.raises(ValueError, match="cannot be read"):
        Settings(api_key_file=str(tmp_path / "missing"))


def _gauge(text: str, name: str) -> float:
    """The value of the sample of `name` in a Prometheus text exposition."""
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_info_tells_no_key_what_the_caches_hold(suffix_engine, api_client) -> None:
    """With keys, /info's figures of what the prefix cache and the index hold now are null: key B reading them
    before and after key A's request would learn how long A's prompt and answer were. The limits stay. The totals
    stay in /metrics, an operator's, behind the key; without keys (one user) /info shows them."""
    async with api_client(suffix_engine, api_keys=KEYS) as c:
        before = (await c.get("/info", headers=_auth(KEY_B))).json()
        await _probe(c, _auth(KEY_A))
        after = (await c.get("/info", headers=_auth(KEY_B))).json()
        metrics = await c.get("/metrics", headers=_auth(KEY_A))
        unkeyed = await c.get("/metrics")
    for info in (before, after):
        held = [info[f] for f in ("prefix_cache_used_bytes", "suffix_index_used_bytes", "suffix_index_answers")]
        assert held == [None, None, None], info
        assert info["suffix_index_bytes"] == 1 << 22 and "prefix_cache_bytes" in info
    assert unkeyed.status_code == 401
    assert _gauge(metrics.text, "specserve_suffix_index_answers") >= 1
    async with api_client(suffix_engine) as c:
        await _probe(c)
        info = (await c.get("/info")).json()
    assert info["suffix_index_answers"] >= 1 and info["suffix_index_used_bytes"] > 0


async def test_the_digit_probe_reads_a_code_within_a_tenant_and_nothing_across_tenants(
    make_tiny_model, byte_tokenizer, api_client
) -> None:
    """Finding 1's probe (tools/digit_probe.py): 60 probes, one per digit of each position of another client's
    6-digit code, each asking whether pass 2 drafted from the index after the guessed digit. Within one tenant (a
    keyless server's unsalted requests, the shared default) it reads the code, which shows the probe works; with
    two keys, and without keys under `isolation: strict`, none of the 60 probes is informative."""
    tokenizer = byte_tokenizer()
    async with api_client(_tiny_suffix_engine(make_tiny_model, tokenizer)) as c:
        shared = await digit_probe.read_code(c, {}, {})
    assert (shared.informative, shared.probes, shared.code) == (6, 60, digit_probe.CODE)

    async with api_client(_tiny_suffix_engine(make_tiny_model, tokenizer), api_keys=KEYS) as c:
        keyed = await digit_probe.read_code(c, _auth(KEY_A), _auth(KEY_B))
    assert (keyed.informative, keyed.probes) == (0, 60), keyed.hits

    async with api_client(_tiny_suffix_engine(make_tiny_model, tokenizer), isolation="strict") as c:
        strict = await digit_probe.read_code(c, {}, {})
    assert (strict.informative, strict.probes) == (0, 60), strict.hits
