"""What requests and responses of every dialect share: the strict configuration of nested objects, the
sampling fields' types, the neutral-only fields, integers, and the descriptions several dialects' fields repeat."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, WithJsonSchema

# Nested objects refuse a field they do not know (a 4xx naming its path): a field we do not read would be
# dropped without a word. The top levels of the requests keep theirs to log them (see `ignored_fields`).
REQUEST_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


MAX_TEMPERATURE = 100.0
# The smallest positive temperature: below it, logits / temperature can overflow float32 and the
# probabilities become NaN. Anything this small is greedy in all but name.
MIN_TEMPERATURE = 1e-6
MAX_SEED = 2**64 - 1  # the range of a torch.Generator seed (TGI's seed is a u64 too)


def _check_temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return value


Temperature = Annotated[
    float,
    Field(ge=0, le=MAX_TEMPERATURE),
    AfterValidator(_check_temperature),
    WithJsonSchema(
        {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}]}
    ),
]


RepetitionPenalty = Annotated[
    float,
    Field(
        gt=0,
        le=10,
        description="a token already in the text (prompt included) has its logit divided by this when positive, "
        "multiplied when negative (HF's, TGI's and vLLM's rule); 1.0: none; applied alike to the draft and the target",
    ),
]
OpenAIPenalty = Annotated[float, Field(ge=-2, le=2)]


def neutral_only(annotation: Any, *allowed: Any) -> Any:
    """A field the clients send that we cannot honour: accepted only at its neutral values."""
    shown = " or ".join(json.dumps(a) for a in allowed if a is not None)
    hint = f"leave it unset or send {shown}" if shown else "leave it unset"

    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"not supported: {hint}")
        return value

    return Annotated[
        annotation,
        AfterValidator(check),
        WithJsonSchema({"enum": list(allowed)}),
        Field(description=f"not supported: {hint}"),
    ]


NonEmptyStr = Annotated[str, Field(min_length=1)]


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer, and so do clients that send every number as a float.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**constraints: Any) -> Any:
    """A strict integer that also takes an integral float; constraints come first, or the schema loses them."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


def _unset(value: Any) -> bool:
    return value is None


def omitted_if_none(description: str | None = None) -> Any:
    """A response field left out of the JSON when None (its users say why)."""
    return Field(None, exclude_if=_unset, description=description)


# A salt is a secret: whoever sends the same salt (with the same API key) reads what this tenant's answers left in
# the caches, through how fast its own come. Short enough to guess, it would be no boundary at all.
MIN_CACHE_SALT = 16
CacheSalt = Annotated[str, Field(min_length=MIN_CACHE_SALT, max_length=256)]
CACHE_SALT_HELP = (
    f"a secret ({MIN_CACHE_SALT}-256 characters; vLLM's cache_salt) naming the tenant within the request's API key: "
    "the prefix cache and the index of earlier answers are used within requests of the same key and salt only, so "
    "that no other tenant's text changes how fast this answer comes"
)


PREDICTION_HELP = (
    "text the answer will mostly be (OpenAI's predicted outputs: a code edit's file): drafted from wherever the "
    "answer follows it and verified like any draft, so the answer is the same, only sooner; usage reports "
    "completion_tokens_details.accepted_prediction_tokens and rejected_prediction_tokens"
)


LOGPROB_HELP = "log-probability under the target's raw distribution (log-softmax of its logits, temperature 1)"
