"""A short fuzz of the OpenAPI schema in process: whatever schemathesis sends, valid or not, is never a 5xx.

Limits are tiny (2 new tokens) so that the generations it triggers are cheap. The two-minute run the issue
asks for is `schemathesis run http://127.0.0.1:PORT/openapi.json` against `specserve serve`
(docs/service.md, Testing the service).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from app.api.server import create_app
from app.service.settings import Settings
from tests.conftest import TEST_HOSTS

OPERATIONS = [
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/health"),
    ("GET", "/info"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
]


@pytest.fixture(scope="module")
def api_schema(api_engine):
    # schemathesis calls the app through Starlette's TestClient, which runs the lifespan around each call.
    settings = Settings(max_new_tokens=2, default_max_new_tokens=2, max_queue_size=64, allowed_hosts=TEST_HOSTS)
    app = create_app(settings, api_engine)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_every_operation_is_documented(api_schema) -> None:
    found = sorted((op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations())
    assert found == sorted(OPERATIONS)


# A GET without parameters has no invalid form: negative cases only for the operations with a body.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_server_error(api_schema, method: str, path: str, mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case) -> None:
        response = case.call()
        assert response.status_code < 500, (case.body, response.status_code, response.text)

    fuzz()
