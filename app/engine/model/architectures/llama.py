"""The Llama family: Llama 2/3, Mistral and SmolLM (a GGUF's `smollm`; SmolLM's HF checkpoints say `llama`). Their
block is the plain one every other architecture adds to (RMSNorm, grouped-query attention with RoPE, SwiGLU; q/k/v
biases where an HF config sets `attention_bias`), and the C layer stack runs it (`fused_stack`). llama.cpp permutes
their q/k rows for its interleaved RoPE, which the GGUF layer undoes (`base.unpermute_rope`)."""

from __future__ import annotations

from typing import Any

from app.engine.model.architectures.base import (
    Architecture,
    Layer,
    Meta,
    Weight,
    gguf_attention_mlp,
    hf_attention_mlp,
)
from app.engine.model.config import ModelConfig


def _fields(meta: Meta, common: dict[str, Any]) -> dict[str, Any]:
    return {"fused_stack": True}


def _hf_fields(c: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    return {"fused_stack": True, "qkv_bias": bool(c.get("attention_bias", False))}


def _gguf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    return gguf_attention_mlp(t, config, permuted=True)


def _entry(name: str, hf: tuple[str, ...]) -> Architecture:
    return Architecture(
        name,
        "Llama block: RMSNorm, grouped-query attention with RoPE, SwiGLU",
        _fields,
        _gguf_layer,
        hf_model_types=hf,
        hf_config=_hf_fields,
        hf_layer=hf_attention_mlp,
    )


LLAMA = _entry("llama", ("llama",))
MISTRAL = _entry("mistral", ("mistral",))
SMOLLM = _entry("smollm", ())
