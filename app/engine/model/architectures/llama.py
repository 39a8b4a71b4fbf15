"""The Llama family: Llama 2/3, Mistral and SmolLM (a GGUF's `smollm`; SmolLM's HF checkpoints say `llama`). Their
block is the plain one every other architecture adds to (RMSNorm, grouped-query attention with RoPE, SwiGLU; q/k/v
biases where an HF config sets `attention_bias`; every layer sliding where it sets `sliding_window`, as Mistral 7B
v0.1's does), and the C layer stack runs it (`fused_stack`). llama.cpp permutes
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
    # Mistral 7B v0.1's config gives every layer a window (later Mistrals say null): read, not dropped, so that
    # positions past it attend as transformers has them attend.
    window = int(c.get("sliding_window") or 0)
    sliding = tuple(range(common["n_layers"])) if window else ()
    return {
        "fused_stack": True,
        "qkv_bias": bool(c.get("attention_bias", False)),
        "sliding_window": window,
        "sliding_layers": sliding,
    }


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
