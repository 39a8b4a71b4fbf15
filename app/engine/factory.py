"""Building an Engine from model names or paths, as the CLI and the server ask for one."""

from __future__ import annotations

import logging
from pathlib import Path

from app import store
from app.engine.defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SCHEDULE,
    DEFAULT_DRAFT_WEIGHTS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_SECONDS,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_SUFFIX_INDEX_MB,
    DEFAULT_TENANT_CACHE_SHARE,
)
from app.engine.drafting.base import Drafter, DraftError
from app.engine.drafting.eagle import EagleDrafter, EagleError, is_eagle_dir, load_draft
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.registry import DraftContext, builtin, lookup_names
from app.engine.drafting.suffix_index import TrafficIndex
from app.engine.engine import Engine
from app.engine.model.loading import LoadedModel, load_model

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
# "default": the draft the catalog ships for the target (a trained feature draft for the default target);
# prompt lookup for a target without one.
DEFAULT_DRAFT = "default"
FALLBACK_DRAFT = "suffix"
# Prompt lookup where the text repeats, the loaded model draft elsewhere (registered with any model draft).
HYBRID = "hybrid"


def default_draft_name(target: str) -> str:
    """The draft `--draft default` means for `target`."""
    return store.default_draft_for(target) or FALLBACK_DRAFT


def build_engine(
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    dtype: str = "auto",
    device: str = "auto",
    max_seq_len: int | None = None,
    draft_schedule: str = DEFAULT_DRAFT_SCHEDULE,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    prefill_step_seconds: float = DEFAULT_PREFILL_STEP_SECONDS,
    cache_dir: Path | None = None,
    weights: str = "auto",
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    suffix_index_mb: float = DEFAULT_SUFFIX_INDEX_MB,
    draft_weights: str = DEFAULT_DRAFT_WEIGHTS,
    tenant_cache_share: float = DEFAULT_TENANT_CACHE_SHARE,
) -> tuple[Engine, LoadedModel]:
    """Load `target` (catalog name or path) and `draft` (catalog name, path, `default`, `ngram` or `none`).

    The n-gram drafter is always available by name; a model draft (a small decoder sharing the target's
    vocabulary, or a feature draft trained with `specserve train-draft`) is registered under the name it
    was given and becomes the default. The draft-length defaults are the server's (app.engine.defaults).
    Raises store.ModelStoreError for a missing model and drafters.DraftError for a draft that does not fit
    the target. `cache_dir` (default: the model store's, $SPECSERVE_CACHE) is where the engine keeps what it
    builds (the CPU kernels): the engine itself knows nothing of the store. `weights`: how a GGUF's quantized
    matrices are held (`load_model`; a model draft follows the target). `suffix_index_mb`: the memory the index of
    earlier answers that the lookups draft from may hold (0: none kept). `draft_weights`: how a feature draft's
    matrices run on the target's CPU kernel (`app.engine.defaults.DRAFT_WEIGHTS`). `tenant_cache_share`: the share
    of the prefix cache and of the index that each tenant is owed (`app.engine.prefix_cache`).
    """
    if suffix_index_mb < 0:
        raise DraftError("suffix_index_mb must be 0 or more")
    cache_dir = store.cache_dir() if cache_dir is None else cache_dir
    if draft == HYBRID:  # the hybrid is built on the target's catalog draft
        if default_draft_name(target) == FALLBACK_DRAFT:
            raise DraftError(f"no catalog draft for {target!r} to build the hybrid on; name a draft instead")
        draft = "default"
    loaded = load_model(store.resolve(target), dtype, device, max_seq_len, cache_dir, weights)
    traffic = TrafficIndex(int(suffix_index_mb * 2**20), tenant_cache_share)
    drafters: dict[str, Drafter] = {}
    model: Drafter | None = None
    default = default_draft_name(target) if draft == "default" else draft
    if default not in ("none", *lookup_names()):
        path = store.resolve(default)
        if is_eagle_dir(path):
            try:
                model = EagleDrafter(default, load_draft(path, loaded.model, draft_weights), loaded)
            except EagleError as exc:
                raise DraftError(f"draft {default!r}: {exc}") from exc
        else:
            draft_model = load_model(path, loaded.model.dtype, loaded.model.device, max_seq_len, cache_dir, weights)
            model = ModelDrafter(default, draft_model, loaded)
        drafters[default] = model
    drafters.update(builtin(DraftContext(model, traffic)))
    # `default` with a model draft means the hybrid: measured on Spec-Bench it beats the model draft and the
    # lookup alone (README, Benchmarks).
    if draft == "default" and HYBRID in drafters:
        default = HYBRID
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        drafters,
        default,
        num_draft_tokens,
        draft_schedule=draft_schedule,
        draft_p_min=draft_p_min,
        prefill_chunk=prefill_chunk,
        prefill_step_seconds=prefill_step_seconds,
        prefix_cache_mb=prefix_cache_mb,
        traffic=traffic,
        tenant_cache_share=tenant_cache_share,
    )
    if drafters and draft_schedule == "adaptive":
        # The first requests then choose their draft lengths from this machine's costs (a fraction of a second).
        engine.calibrate()
    return engine, loaded
