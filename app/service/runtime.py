"""What the routes serve with once the models are loaded: the scheduler, the tokenizer, facts about the models.

Building one from settings loads the target and the draft (seconds); building one from an engine that is
already loaded (tests) does not.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app import __version__
from app.engine.decoding.grammar import Grammars
from app.engine.engine import Engine
from app.engine.memory import auto_budget, format_bytes
from app.engine.model.tokenizer import Tokenizer
from app.service.metrics import Metrics
from app.service.scheduler import Scheduler, largest_request_bytes
from app.service.settings import Settings

if TYPE_CHECKING:
    from app.distill.online import DraftLearner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """The loaded models as /info and the OpenAI API describe them."""

    model_id: str
    served_model_name: str  # the id answers report
    served_model_names: tuple[str, ...]  # every `model` a request may name: served_model_name, then its aliases
    dtype: str
    device: str
    weights: str  # what the target's weights run as (Transformer.weights)
    weight_bytes: int
    context_length: int
    vocab_size: int
    default_draft: str
    drafts: tuple[str, ...]  # every name a request may ask for, "none" included
    num_draft_tokens: int
    draft_schedule: str
    draft_p_min: float
    max_input_tokens: int
    has_chat_template: bool
    kernel: str  # the CPU kernel the products and attention run on ("torch": oneDNN/SDPA), or the device type
    batched_decoding: bool  # requests share target forwards (only where rows are independent of the batch)
    # the OpenAI routes' temperature when a request sends none (settings.default_temperature, else the target's
    # generation config, else 1.0 as vLLM and OpenAI)
    default_temperature: float = 1.0
    version: str = __version__
    created: int = field(default_factory=lambda: int(time.time()))  # when the models were loaded (/v1/models)


@dataclass
class Runtime:
    """A started scheduler over a loaded engine, and what requests are validated against."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    info: ModelInfo
    learner: DraftLearner | None = None

    @property
    def grammars(self) -> Grammars:
        """The engine's grammar compiler: requests' output constraints are checked with it before queueing."""
        return self.scheduler.engine.grammars

    @property
    def suffix_index(self) -> tuple[int, int, int]:
        """The index of earlier answers: (limit, bytes held now, answers held); zeros where there is none."""
        index = self.scheduler.engine.traffic
        return (index.max_bytes, index.bytes, index.sequences) if index is not None else (0, 0, 0)

    @property
    def prefix_cache_bytes(self) -> tuple[int, int]:
        """The prefix cache's (limit, bytes held now); (0, 0) where there is none."""
        cache = self.scheduler.engine.prefix_cache
        return (cache.max_bytes, cache.bytes) if cache is not None else (0, 0)

    @classmethod
    def from_engine(
        cls, engine: Engine, settings: Settings, metrics: Metrics | None, generation_temperature: float | None = None
    ) -> Runtime:
        """Wrap a loaded engine and start its worker; `generation_temperature` is the target's generation config's
        (the OpenAI routes' default temperature unless the settings give one)."""
        config = engine.target.config
        context = config.max_seq_len
        # A prompt leaves room for at least one new token.
        max_input = min(settings.max_input_tokens or context - 1, context - 1)
        info = ModelInfo(
            model_id=settings.target,
            served_model_name=settings.served_model_names[0],
            served_model_names=tuple(settings.served_model_names),
            dtype=str(engine.target.dtype).removeprefix("torch."),
            device=str(engine.target.device),
            weights=engine.target.weights()[0],
            weight_bytes=engine.target.weights()[1],
            context_length=context,
            vocab_size=config.vocab_size,
            default_draft=engine.default_draft,
            drafts=("default", "none", *engine.drafters),
            num_draft_tokens=engine.num_draft_tokens,
            draft_schedule=engine.draft_schedule,
            draft_p_min=engine.draft_p_min,
            max_input_tokens=max_input,
            has_chat_template=engine.tokenizer.chat_template is not None,
            kernel=engine.kernel,
            batched_decoding=engine.batching,
            default_temperature=next(
                t for t in (settings.default_temperature, generation_temperature, 1.0) if t is not None
            ),
        )
        learner = draft_learner(engine, settings)
        if metrics is not None:
            k = engine.num_draft_tokens if engine.drafters else 0
            metrics.engine_started(info.kernel, info.dtype, engine.batching, k)
            if engine.traffic is not None:
                metrics.watch_index(engine.traffic)
            if learner is not None:
                metrics.watch_learner(learner)
        scheduler = Scheduler(
            engine,
            settings.max_concurrent_requests,
            settings.max_queue_size,
            metrics,
            kv_budget=kv_budget(engine, settings),
            queue_timeout=settings.queue_timeout,
            max_backlog=settings.max_stream_backlog,
            stall_timeout=settings.send_timeout,
            idle=learner,
        )
        scheduler.start()
        if learner is not None:
            learner.start()
        return cls(scheduler, engine.tokenizer, info, learner)

    @classmethod
    def load(cls, settings: Settings, metrics: Metrics | None) -> Runtime:
        """Load the target and the draft named in `settings` and start the worker (blocks for seconds)."""
        from app.engine.factory import build_engine

        engine, _ = build_engine(
            settings.target,
            settings.draft,
            settings.num_draft_tokens,
            settings.dtype,
            settings.device,
            draft_schedule=settings.draft_schedule,
            draft_p_min=settings.draft_p_min,
            prefill_chunk=settings.prefill_chunk_tokens,
            prefill_step_seconds=settings.prefill_step_seconds,
            prefix_cache_mb=settings.prefix_cache_mb,
            suffix_index_mb=settings.suffix_index_mb,
            tenant_cache_share=settings.tenant_cache_share,
            weights=settings.weights,
            draft_weights=settings.draft_weights,
        )
        return cls.from_engine(engine, settings, metrics, generation_temperature(settings.target))

    def close(self) -> None:
        """Stop the worker (requests still held fail with 503) and the draft learner."""
        self.scheduler.stop()
        if self.learner is not None:
            self.learner.stop()


def draft_learner(engine: Engine, settings: Settings) -> DraftLearner | None:
    """The draft learner `settings.draft_learning` asks for, wired into `engine` (its answers, its feature draft's
    adapters); None when off. ValueError where there is no feature draft to learn."""
    if settings.draft_learning != "on":
        return None
    from app.distill.online import DraftLearner, LearningConfig, feature_drafter

    eagle = feature_drafter(engine)
    if eagle is None or eagle.draft.source is None:
        raise ValueError("draft_learning on needs a feature draft (a draft made by `specserve train-draft`)")
    directory = Path(settings.draft_learning_dir) if settings.draft_learning_dir else None
    config = LearningConfig(memory_bytes=int(settings.draft_learning_mb * 2**20))
    learner = DraftLearner(eagle.draft.source, engine.target, config, directory)
    engine.on_answer = learner.observe
    eagle.adapters = learner.adapter
    log.info("draft learning on for %s (adapters %s)", eagle.name, f"kept in {directory}" if directory else "in memory")
    return learner


def kv_budget(engine: Engine, settings: Settings) -> int:
    """The bytes of KV cache admission allows (`kv_cache_memory`; `auto`: a share of the memory available now,
    the models loaded), logged with what it holds."""
    largest = largest_request_bytes(engine)
    budget = settings.kv_cache_memory_bytes
    how = "kv_cache_memory"
    if budget is None:
        # Where nothing says what memory there is, what the four places before admission by memory held.
        budget, how = auto_budget(engine.target.device, 4 * largest)
    fits = budget // largest
    (log.info if fits else log.warning)(
        "KV-cache budget %s (%s): room for %d full-length requests (%s each) or more shorter ones; at most %d run",
        format_bytes(budget),
        how,
        fits,
        format_bytes(largest),
        settings.max_concurrent_requests,
    )
    return budget


def generation_temperature(target: str) -> float | None:
    """The temperature of the target's generation config (`generation_config.json` of an HF checkpoint
    directory), which vLLM takes as its default; None when there is none (a GGUF carries no such config)."""
    from app import store

    try:
        path = store.resolve(target)
    except Exception:  # the engine's own load reports a target it cannot find
        return None
    config = path / "generation_config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("temperature")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and 0 <= value <= 100 else None
