"""Our extensions of both APIs: how to speculate (`speculative`), what speculation did, and where each streamed
token came from (`provenance`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.schemas.common import integer, omitted_if_none
from app.engine.defaults import MAX_DRAFT_TOKENS
from app.engine.drafting.registry import REGISTRY

PROVENANCE_HELP = (
    "our extension: add `provenance` to every streamed event, saying what proposed each token (the draft, prompt "
    "lookup, the target's correction or bonus token...) and what each target pass did; only when streaming "
    "(docs/service.md, Provenance)"
)


class ProvenanceToken(BaseModel):
    """One generated token and what proposed it."""

    model_config = ConfigDict(serialize_by_alias=True)

    id: int
    text: str = Field(description="the text it added (as the event's token or delta)")
    source: Literal["target", "draft", "lookup", "forced", "correction", "bonus"] = Field(
        description="`draft`: proposed by the model draft and accepted; `lookup`: by prompt lookup, accepted; "
        "`correction`: the target's token in place of the first rejected drafted one; `bonus`: the target's token "
        "after every drafted one was accepted; `target`: the target's token in a pass without a draft; `forced`: "
        "the only token the grammar allowed"
    )
    target_pass: int = Field(serialization_alias="pass", description="which target pass kept it, from 1 (prefill)")
    logprob: float | None = Field(description="its log-probability under the target's raw distribution")


class ProvenancePass(BaseModel):
    """What one target pass of the request did."""

    model_config = ConfigDict(serialize_by_alias=True)

    target_pass: int = Field(serialization_alias="pass", description="from 1: the pass that ended the prefill")
    drafted: int = Field(description="tokens the draft proposed for this pass to verify: the draft length")
    accepted: int = Field(description="of them, the ones the target kept")
    draft_ms: float = Field(description="milliseconds drafting them took")
    verify_ms: float = Field(description="milliseconds the target's pass took (a batch's: the whole batch's)")


class Provenance(BaseModel):
    """Where the tokens of a streamed event came from (with `provenance: true`)."""

    tokens: list[ProvenanceToken] = Field(description="the event's tokens, in order")
    passes: list[ProvenancePass] = Field(description="the target passes whose first token is in this event")


def provenance_field() -> Any:
    # Left out when None: without the request field a stream is byte for byte what it was without the feature.
    return omitted_if_none("with `provenance: true` only (our extension)")


def draft_help() -> str:
    """What `speculative.draft` may name: `default`, `none`, each built-in drafter the registry
    (app.engine.drafting.registry) holds now, with its description, or the loaded model draft."""
    builtin = ", ".join(
        f"`{name}` ({'with a model draft only: ' if entry.needs_model else ''}{entry.description})"
        for name, entry in REGISTRY.items()
    )
    return f"`default`, `none` (target only), {builtin}, or the name of the loaded model draft"


class SpeculativeParameters(BaseModel):
    """How to speculate for this request (our extension of both APIs)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    num_draft_tokens: integer(ge=0, le=MAX_DRAFT_TOKENS) | None = Field(
        None, description="tokens drafted per step (0: target only); default: the server's"
    )
    draft: str | None = Field(
        None,
        description=draft_help(),
        # Written again whenever a JSON schema is built (the app's OpenAPI document): a drafter registered after
        # this import is listed too. What a request may name is the engine's (jobs: /info's available_drafts).
        json_schema_extra=lambda schema: schema.update(description=draft_help()),
    )
    schedule: Literal["adaptive", "heuristic", "fixed"] | None = Field(
        None,
        description="draft length per step: `adaptive` (the length that maximises expected tokens/s from measured "
        "acceptance and costs; num_draft_tokens is the most), `heuristic` (+2 after a full accept, -1 otherwise) "
        "or `fixed`; default: the server's",
    )
    p_min: float | None = Field(
        None,
        ge=0,
        le=1,
        description="confidence cut-off: a model draft stops below this top probability; "
        "0 turns it off; default: the server's",
    )
    lookup_draft_tokens: integer(ge=0, le=MAX_DRAFT_TOKENS) | None = Field(
        None,
        description="with the adaptive schedule, the most tokens a lookup in text already written (the request's own, "
        "its `prediction`, the tenant's earlier answers) drafts per step, where its measured acceptance pays for "
        "the rows; num_draft_tokens bounds the model draft's; default: the server's (16)",
    )
    sampler: Literal["gumbel", "rejection"] | None = Field(
        None,
        description="how sampled tokens are drawn: `gumbel` (default: each position's noise depends on the seed and "
        "the position only, so a seed gives the same text whatever the draft, its length or the batch) or "
        "`rejection` (the rejection sampler: a model draft is accepted more often, but the text a seed gives "
        "depends on the draft and its lengths); greedy decoding ignores it",
    )

    def params(self) -> dict[str, Any]:
        """The fields of the engine's `GenerationParams` these set (the draft and its length are resolved against
        the server's, `app.api.jobs`)."""
        return {
            "draft_schedule": self.schedule,
            "draft_p_min": self.p_min,
            "sampler": self.sampler or "gumbel",
            "lookup_draft_tokens": self.lookup_draft_tokens,
        }


NO_SPECULATIVE = SpeculativeParameters()


class SpeculativeDetails(BaseModel):
    """What speculation did for this request."""

    draft: str = Field(description="the draft that proposed (`none`: target only)")
    num_draft_tokens: int = Field(description="tokens drafted per step at most")
    drafted: int = Field(description="tokens the draft proposed")
    accepted: int = Field(description="drafted tokens the target accepted")
    forced: int = Field(
        0, description="tokens the grammar allowed alone, proposed without the draft and kept (not in drafted)"
    )
    refused: int = Field(
        0, description="drafted tokens the grammar refused before verification (in drafted, never accepted)"
    )
    target_passes: int = Field(description="target forward passes, prefill included")
    verify_passes: int = Field(description="target passes that verified at least one drafted token")
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted)")
    tokens_per_target_pass: float = Field(description="generated tokens / target passes")
    accepted_per_position: list[int] = Field(description="accepted drafted tokens at each draft position")
    schedule: str = Field(description="the draft-length schedule used (`none` without a draft)")
    p_min: float = Field(description="the confidence cut-off used")
    draft_lengths: list[int] = Field(description="[k]: steps that asked the draft for k tokens")
    p_min_stops: int = Field(description="steps whose draft stopped early below p_min")
    draft_sources: dict[str, int] = Field(
        default_factory=dict,
        description="steps whose verified draft came from each source: `model`, or a lookup in `prompt` (the "
        "request's own text), `prediction` or `index` (the tenant's earlier answers)",
    )
    accepted_prediction_tokens: int = Field(0, description="tokens of the prediction drafted and kept")
    rejected_prediction_tokens: int = Field(0, description="tokens of the prediction drafted and rejected")
    sampler: Literal["greedy", "gumbel", "rejection"] = Field(
        description="how tokens were chosen: `greedy`, or the sampler that drew them"
    )
