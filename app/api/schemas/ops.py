"""The operations routes' responses: /health and /info."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "draining"]
    error: str | None = Field(None, description="why loading failed, or why the worker is gone")


class Info(BaseModel):
    """The served models and the limits requests are held to."""

    model_id: str
    served_model_name: str = Field(description="the model id the OpenAI answers report")
    served_model_names: list[str] = Field(
        description="every `model` the OpenAI routes accept: served_model_name, then its aliases"
    )
    model_dtype: str
    model_device_type: str
    model_weights: str = Field(
        description="what the target's weights run as: `bfloat16`, `float32`, or the GGUF formats computed on as "
        "the file's blocks (`Q8_0+Q4_1`; `+bfloat16` where some matrices are not), see --weights"
    )
    model_weight_bytes: int = Field(description="bytes the target's weights hold in memory")
    cpu_kernel: str = Field(
        description="what runs the target's products and attention: amxint8, amx, avx512vnni, avx512, avxvnni, "
        "avx2 or generic (specserve's kernels, each row independent of the batch), torch (oneDNN and SDPA), or the "
        "device type off the CPU"
    )
    batched_decoding: bool = Field(
        description="whether requests share target forwards; off where a row's bits would depend on the batch"
    )
    draft: str = Field(description="the default draft")
    available_drafts: list[str]
    num_draft_tokens: int = Field(description="k, tokens drafted per step by default")
    draft_schedule: str = Field(description="the default draft-length schedule")
    draft_p_min: float = Field(description="the default confidence cut-off of model drafts")
    max_input_tokens: int
    max_new_tokens: int
    max_total_tokens: int = Field(description="the model's context")
    max_stop_sequences: int
    max_concurrent_requests: int = Field(description="the most generations running at once")
    kv_cache_memory_bytes: int = Field(
        description="the KV-cache budget in bytes: requests are admitted while their caches fit in it together "
        "(kv_cache_memory; `auto` resolved at start-up)"
    )
    max_queue_size: int
    prefix_cache_bytes: int = Field(
        description="memory the automatic prefix cache may hold (--prefix-cache-mb); 0: off (or rows depend on the "
        "batch: torch's path, a device)"
    )
    prefix_cache_used_bytes: int | None = Field(
        description="memory the prefix cache holds now; null on a server with API keys (see suffix_index_answers)"
    )
    suffix_index_bytes: int = Field(
        0, description="memory the index of earlier answers may hold (--suffix-index-mb); 0: none kept"
    )
    suffix_index_used_bytes: int | None = Field(
        0, description="memory the index of earlier answers holds now; null on a server with API keys"
    )
    suffix_index_answers: int | None = Field(
        0,
        description="answers the index holds now, all tenants together; null on a server with API keys, where "
        "every key reads /info and the change between two reads would be another tenant's answers and their size "
        "(the totals are in /metrics, the operator's)",
    )
    request_timeout: float
    version: str
