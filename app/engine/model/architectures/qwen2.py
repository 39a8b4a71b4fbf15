"""Qwen2/2.5: the Llama block with q/k/v biases; llama.cpp keeps its q/k rows in HF's rotate-half order."""

from __future__ import annotations

from typing import Any

from app.engine.model.architectures.base import Architecture, Meta, gguf_attention_mlp, hf_attention_mlp


def _fields(meta: Meta, common: dict[str, Any]) -> dict[str, Any]:
    return {"fused_stack": True}


def _hf_fields(c: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    return {"fused_stack": True, "qkv_bias": True}


QWEN2 = Architecture(
    "qwen2",
    "Llama block with q/k/v biases",
    _fields,
    gguf_attention_mlp,
    hf_model_types=("qwen2",),
    hf_config=_hf_fields,
    hf_layer=hf_attention_mlp,
)
