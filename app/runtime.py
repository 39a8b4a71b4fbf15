"""What the routes serve with once the models are loaded: the scheduler, the tokenizer, facts about the models.

Building one from settings loads the target and the draft (seconds); building one from an engine that is
already loaded (tests) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from app import __version__
from app.engine.generation import Engine
from app.engine.grammar import Grammars
from app.engine.tokenizer import Tokenizer
from app.metrics import Metrics
from app.settings import Settings
from app.worker import Scheduler


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
    version: str = __version__


@dataclass
class Runtime:
    """A started scheduler over a loaded engine, and what requests are validated against."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    info: ModelInfo

    @property
    def grammars(self) -> Grammars:
        """The engine's grammar compiler: requests' output constraints are checked with it before queueing."""
        return self.scheduler.engine.grammars

    @classmethod
    def from_engine(cls, engine: Engine, settings: Settings, metrics: Metrics | None) -> Runtime:
        """Wrap a loaded engine and start its worker."""
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
        )
        if metrics is not None:
            k = engine.num_draft_tokens if engine.drafters else 0
            metrics.engine_started(info.kernel, info.dtype, engine.batching, k)
        scheduler = Scheduler(engine, settings.max_concurrent_requests, settings.max_queue_size, metrics)
        scheduler.start()
        return cls(scheduler, engine.tokenizer, info)

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
            weights=settings.weights,
        )
        return cls.from_engine(engine, settings, metrics)

    def close(self) -> None:
        """Stop the worker; requests still held fail with 503."""
        self.scheduler.stop()
