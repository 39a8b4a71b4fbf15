"""Building an Engine from model names or paths, as the CLI and the server ask for one."""

from __future__ import annotations

import logging

from app import store
from app.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from app.engine.generation import Engine
from app.engine.loading import LoadedModel, load_model

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
# Until a trained draft ships for the default target, prompt lookup is the default draft.
DEFAULT_DRAFT = "ngram"


def build_engine(
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    num_draft_tokens: int = 4,
    dtype: str = "auto",
    device: str = "auto",
    max_seq_len: int | None = None,
) -> tuple[Engine, LoadedModel]:
    """Load `target` (catalog name or path) and `draft` (catalog name, path, `ngram` or `none`).

    The n-gram drafter is always available by name; a model draft is registered under the name it was
    given and becomes the default. Raises store.ModelStoreError for a missing model and
    drafters.DraftError for a draft that does not fit the target.
    """
    loaded = load_model(store.resolve(target), dtype, device, max_seq_len)
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
    default = draft
    if draft == "default":
        default = DEFAULT_DRAFT
    if default not in ("none", "ngram"):
        draft_model = load_model(store.resolve(default), loaded.model.dtype, loaded.model.device, max_seq_len)
        drafters[default] = ModelDrafter(default, draft_model, loaded)
    engine = Engine(loaded.model, loaded.tokenizer, drafters, default, num_draft_tokens)
    return engine, loaded
