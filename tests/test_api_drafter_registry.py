"""A drafter registered in a test module shows up in the API's schema (the OpenAPI document's `speculative.draft`)
and in /info with no other edit (issue 69, item 4): every list of drafter names is read from the registry
(app.engine.drafting.registry), the schema's when the app's OpenAPI document is built, not when it is imported."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.api.server import create_app
from app.engine.drafting.ngram import NgramDrafter
from app.engine.drafting.registry import REGISTRY, DraftContext, DrafterEntry, builtin, register
from app.engine.engine import Engine
from app.service.settings import Settings
from tests.conftest import FIXED_DRAFT, TEST_HOSTS

pytestmark = pytest.mark.anyio

NAME = "registered-in-a-test"
DESCRIPTION = "a lookup only this test registers"


@pytest.fixture
def registered() -> Iterator[None]:
    """A drafter registered as a new drafter module would register itself, removed afterwards."""
    register(DrafterEntry(NAME, DESCRIPTION, lambda ctx: NgramDrafter()))
    try:
        yield
    finally:
        del REGISTRY[NAME]


async def test_a_registered_drafter_is_listed_and_served(registered, make_tiny_model, word_tokenizer) -> None:
    model = make_tiny_model()
    # The drafters as build_engine makes them: every registered entry that needs no model draft, here.
    drafters = builtin(DraftContext(None, None))
    assert NAME in drafters
    engine = Engine(model, word_tokenizer(model.config.vocab_size), drafters, "ngram", 4, **FIXED_DRAFT)
    app = create_app(Settings(allowed_hosts=TEST_HOSTS), engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            assert NAME in (await client.get("/info")).json()["available_drafts"]
            schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
            draft = schemas["SpeculativeParameters"]["properties"]["draft"]
            assert NAME in draft["anyOf"][0]["enum"]
            # The schemas were imported before the drafter was registered: the description is built with the app.
            assert f"`{NAME}` ({DESCRIPTION})" in draft["description"]
            body = {"inputs": "t1 t2 t1 t2 t1", "parameters": {"max_new_tokens": 3, "details": True}}
            body["parameters"]["speculative"] = {"draft": NAME}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["details"]["speculative"]["draft"] == NAME
