"""Security of the service in process: the optional API key, CORS, request ids, no tracebacks in answers.

The key (`Authorization: Bearer`) guards every route but /health and, by setting, /metrics, and answers 401
in each API's error shape before any body is read. CORS is off unless origins are configured. Every answer
carries an `X-Request-ID` (the client's, or a new one) and the request's log records carry the same id.
"""

from __future__ import annotations

import io
import json
import logging

import httpx
import openai
import pytest

from app import cli
from app.api import security
from app.api.server import create_app
from app.engine.drafting.base import Drafter, DraftSession
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.service.logs import _JSONFormatter, _RequestIdFilter
from app.service.settings import Settings
from tests.conftest import FIXED_DRAFT

# The requests counter's sample for an outcome, on an app serving the default target.
ENDED = 'specserve_requests_total{finish_reason="none",model_name="smollm2-135m-instruct",outcome='

pytestmark = pytest.mark.anyio

KEY = "s3cret-key_0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
GEN = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 2}}


async def test_without_a_key_configured_everything_is_open(api_client) -> None:
    async with api_client() as client:
        for path in ("/info", "/metrics", "/v1/models", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
        assert (await client.post("/generate", json=GEN)).status_code == 200
        schema = (await client.get("/openapi.json")).json()
    assert "securitySchemes" not in schema["components"]


async def test_api_key_guards_every_route_but_health(api_client) -> None:
    async with api_client(api_key=KEY) as client:
        assert (await client.get("/health")).status_code == 200
        missing = await client.post("/generate", json=GEN)
        wrong = await client.post("/generate", json=GEN, headers={"Authorization": "Bearer not-the-key"})
        basic = await client.post("/generate", json=GEN, headers={"Authorization": f"Basic {KEY}"})
        oai = await client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        refused_gets = {p: (await client.get(p)).status_code for p in ("/info", "/metrics", "/openapi.json", "/docs")}
        nowhere = await client.get("/no-such-route")
        # A body over the limit from a client without the key is refused for the key, unread.
        big = await client.post("/generate", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        ok = await client.post("/generate", json=GEN, headers=AUTH)
        lower_scheme = await client.get("/info", headers={"Authorization": f"bearer {KEY}"})
        metrics = (await client.get("/metrics", headers=AUTH)).text
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json() == {
        "error": "this server requires an API key: send the header Authorization: Bearer <key>",
        "error_type": "unauthorized",
    }
    assert wrong.status_code == 401 and wrong.json() == {
        "error": "the API key is not valid",
        "error_type": "unauthorized",
    }
    assert basic.status_code == 401 and "requires an API key" in basic.json()["error"]
    assert oai.status_code == 401 and oai.json()["error"]["code"] == "unauthorized"
    assert oai.json()["error"]["type"] == "invalid_request_error"
    assert refused_gets == dict.fromkeys(refused_gets, 401)
    assert nowhere.status_code == 401  # routes are not revealed to a client without the key
    assert big.status_code == 401
    assert ok.status_code == 200 and ok.json()["generated_text"]
    assert lower_scheme.status_code == 200
    assert KEY not in lower_scheme.text
    # The refused POSTs count as invalid requests; the refused GETs count nowhere.
    assert f'{ENDED}"invalid"}} 5.0' in metrics


async def test_metrics_public_opens_metrics_only(api_client) -> None:
    async with api_client(api_key=KEY, metrics_public=True) as client:
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/info")).status_code == 401
        schema = (await client.get("/openapi.json", headers=AUTH)).json()
    assert schema["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
    assert schema["security"] == [{"apiKey": []}]
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert schema["paths"]["/metrics"]["get"]["security"] == []
    assert "security" not in schema["paths"]["/generate"]["post"]


async def test_the_key_is_compared_in_constant_time(api_client, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = security.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    async with api_client(api_key=KEY) as client:
        assert (await client.get("/info", headers={"Authorization": "Bearer guess"})).status_code == 401
        assert (await client.get("/info", headers=AUTH)).status_code == 200
    assert calls == [(b"guess", KEY.encode()), (KEY.encode(), KEY.encode())]


async def test_openai_client_with_the_key(api_client) -> None:
    async with api_client(api_key=KEY) as client:
        good = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
        completion = await good.completions.create(
            model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=2, temperature=0
        )
        assert completion.choices[0].text
        bad = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="nope", http_client=client, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


LOOPBACK = ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]", "[::1]:8000", "LocalHost."]
# Names a rebound page's requests carry (its own name, with or without a port) or that only look local.
FOREIGN = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example", "[::2]:8000", "x y"]


async def test_a_keyless_loopback_server_answers_to_loopback_names_only(api_client) -> None:
    """DNS rebinding: a page on evil.example, re-pointed at 127.0.0.1, reaches a keyless local server as its own
    origin, so it could read answers and send work. Its requests carry Host: evil.example, refused with 400 in
    the route's error shape before any body is read; the loopback names pass with any port."""
    async with api_client(allowed_hosts="") as client:  # the default: what `specserve serve` runs
        passed = [(await client.get("/v1/models", headers={"Host": h})).status_code for h in LOOPBACK]
        refused = [await client.get("/info", headers={"Host": h}) for h in FOREIGN]
        chat = await client.post(
            "/v1/chat/completions",
            headers={"Host": "evil.example"},
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        )
        health = await client.get("/health", headers={"Host": "evil.example"})
    assert passed == [200] * len(LOOPBACK)
    assert [r.status_code for r in refused] == [400] * len(FOREIGN)
    body = refused[0].json()
    assert body["error_type"] == "validation" and "Host 'evil.example'" in body["error"]
    assert "--allowed-hosts" in body["error"] and "localhost" in body["error"]
    assert chat.status_code == 400 and "Host 'evil.example'" in chat.json()["error"]["message"]
    assert health.status_code == 400


async def test_allowed_hosts_replaces_the_default_and_keys_or_a_public_host_drop_it(api_client) -> None:
    """--allowed-hosts names the hosts (the default's names too, if wanted); `*` turns the check off; a server
    with a key, or one on a public address told to serve open, checks no Host unless told."""
    async with api_client(allowed_hosts="api.example, ::1") as client:
        named = await client.get("/v1/models", headers={"Host": "API.example:443"})
        bracketed = await client.get("/v1/models", headers={"Host": "[::1]:8000"})
        local = await client.get("/v1/models", headers={"Host": "localhost:8000"})
    async with api_client(allowed_hosts="*") as client:
        anything = await client.get("/v1/models", headers={"Host": "evil.example"})
    async with api_client(allowed_hosts="", api_key=KEY) as client:
        keyed = await client.get("/v1/models", headers={"Host": "evil.example", **AUTH})
    async with api_client(allowed_hosts="", host="0.0.0.0", allow_unauthenticated=True) as client:
        public = await client.get("/v1/models", headers={"Host": "10.0.0.5:8000"})
    assert (named.status_code, bracketed.status_code, local.status_code) == (200, 200, 400)
    assert anything.status_code == keyed.status_code == public.status_code == 200
    assert Settings().trusted_hosts == {"localhost", "127.0.0.1", "[::1]"}
    for bad in ("localhost:8000", "[::1]:80", "a b", "[::1"):
        with pytest.raises(ValueError, match="allowed_hosts"):
            Settings(allowed_hosts=bad)


async def test_a_request_without_a_host_header_is_refused() -> None:
    """HTTP/1.0 lets a request leave Host out: with a Host check on, it is refused, not waved through."""
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:  # pragma: no cover - must not be reached
        raise AssertionError("the request went through")

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = security.TrustedHost(app, hosts={"localhost"})
    await guard({"type": "http", "method": "GET", "path": "/info", "headers": []}, receive, send)
    assert sent[0]["status"] == 400
    assert "no Host header" in json.loads(sent[1]["body"])["error"]


async def test_cors_is_off_unless_configured(api_client) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with api_client() as client:
        r = await client.options("/generate", headers=preflight)
        g = await client.get("/info", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in g.headers

    async with api_client(api_key=KEY, cors_allow_origins="https://app.example, https://other.example") as client:
        allowed = await client.options(
            "/generate", headers={**preflight, "Access-Control-Request-Headers": "authorization"}
        )
        stranger = await client.options("/generate", headers={**preflight, "Origin": "https://evil.example"})
        simple = await client.get("/info", headers={"Origin": "https://other.example", **AUTH})
        refused = await client.get("/info", headers={"Origin": "https://app.example"})
    # A preflight carries no credentials: it is answered before the key is checked.
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
    assert simple.headers["access-control-allow-origin"] == "https://other.example"
    assert "x-request-id" in simple.headers["access-control-expose-headers"].lower()
    # The browser may read the 401 (the allow-origin header is on it too).
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"


async def test_request_ids_in_every_answer(api_client, sse_data) -> None:
    async with api_client(max_body_bytes=1024) as client:
        new = await client.post("/generate", json=GEN)
        again = await client.post("/generate", json=GEN)
        echoed = await client.post("/generate_stream", json=GEN, headers={"X-Request-ID": "trace-42.a:b"})
        odd = await client.get("/health", headers={"X-Request-ID": "has space" + "x" * 200})
        too_large = await client.post("/generate", content=b"x" * 2048, headers={"content-type": "application/json"})
        missing = await client.get("/nowhere", headers={"X-Request-ID": "abc"})
    assert len(new.headers["x-request-id"]) == 32 and new.headers["x-request-id"] != again.headers["x-request-id"]
    assert echoed.headers["x-request-id"] == "trace-42.a:b" and sse_data(echoed.text)
    assert len(odd.headers["x-request-id"]) == 32  # not a sane id: replaced
    assert too_large.status_code == 413 and len(too_large.headers["x-request-id"]) == 32
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "abc"


class _ExplodingDraft(Drafter, DraftSession):
    name = "boom"

    def __init__(self) -> None:
        DraftSession.__init__(self)

    def session(self, capacity: int) -> _ExplodingDraft:
        return self

    def propose(self, token_ids, k: int, p_min: float = 0.0) -> list[int]:
        raise RuntimeError("draft exploded")


@pytest.fixture
def json_log() -> io.StringIO:
    """The JSON lines the service logs during the test, as `specserve serve --log-format json` writes them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(_JSONFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)


async def test_no_traceback_in_answers_and_the_id_in_the_log(api_engine, json_log) -> None:
    engine = Engine(
        api_engine.target,
        api_engine.tokenizer,
        {"ngram": NgramDrafter(), "boom": _ExplodingDraft()},
        "ngram",
        4,
        **FIXED_DRAFT,
    )
    app = create_app(Settings(), engine)

    @app.get("/boom", include_in_schema=False)
    async def boom() -> None:
        raise RuntimeError("secret detail in /etc/passwd")

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            crash = await client.get("/boom", headers={"X-Request-ID": "crash-1"})
            failed = await client.post(
                "/generate",
                json={**GEN, "parameters": {"max_new_tokens": 8, "speculative": {"draft": "boom"}}},
                headers={"X-Request-ID": "failed-2"},
            )
    assert crash.status_code == 500
    assert crash.json() == {"error": "internal error: RuntimeError", "error_type": "internal"}
    assert crash.headers["x-request-id"] == "crash-1"
    assert failed.status_code == 424 and "Traceback" not in failed.text
    assert failed.headers["x-request-id"] == "failed-2"
    records = [json.loads(line) for line in json_log.getvalue().splitlines()]
    by_id = {r.get("request_id"): r for r in records if r["level"] == "error"}
    assert "secret detail" in by_id["crash-1"]["exception"]  # the traceback is in the log, not the answer
    assert by_id["failed-2"]["logger"] == "app.service.scheduler" and "draft exploded" in by_id["failed-2"]["exception"]


def test_key_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_API_KEY", "")
    assert Settings().api_key is None  # compose passes an unset variable as empty
    monkeypatch.setenv("SPECSERVE_API_KEY", KEY)
    monkeypatch.setenv("SPECSERVE_CORS_ALLOW_ORIGINS", "https://a.example,*")
    settings = Settings()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == KEY
    assert KEY not in repr(settings) and KEY not in str(settings.model_dump())
    assert settings.cors_origins == ["https://a.example", "*"]
    assert Settings(cors_allow_origins=" ").cors_origins == []
    with pytest.raises(ValueError, match="printable ASCII"):
        Settings(api_key="two words")
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--metrics-public"]).metrics_public is True
    assert parser.parse_args(["serve", "--no-metrics-public"]).metrics_public is False
    assert parser.parse_args(["serve"]).metrics_public is None  # then SPECSERVE_METRICS_PUBLIC applies


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_log_lines_carry_the_request_id(log_format: str, capsys: pytest.CaptureFixture[str]) -> None:
    from app.service.logs import configure_logging, request_id_var

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(log_format, "info")
        log = logging.getLogger("app.test")
        token = request_id_var.set("rid-7")
        log.info("inside")
        request_id_var.reset(token)
        log.info("outside")
        log.info("from the worker", extra={"request_id": "rid-8"})
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = [line for line in capsys.readouterr().err.splitlines() if "app.test" in line]
    if log_format == "json":
        entries = [json.loads(line) for line in lines]
        assert [e.get("request_id") for e in entries] == ["rid-7", None, "rid-8"]
    else:
        assert lines[0].endswith("INFO app.test [rid-7]: inside")
        assert lines[1].endswith("INFO app.test: outside")
        assert lines[2].endswith("INFO app.test [rid-8]: from the worker")


async def test_health_says_that_loading_failed_but_not_the_exception_text(tmp_path) -> None:
    """/health is open to anyone: it names the exception's type only; its text (a path here) is for the log."""
    import anyio

    missing = tmp_path / "private-dir-4711" / "model.gguf"
    app = create_app(Settings(target=str(missing)))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            with anyio.fail_after(60):
                while (health := await client.get("/health")).json()["status"] == "loading":
                    await anyio.sleep(0.05)
            info = await client.get("/info")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "log" in health.json()["error"]
    assert "private-dir-4711" not in health.text and "private-dir-4711" not in info.text
