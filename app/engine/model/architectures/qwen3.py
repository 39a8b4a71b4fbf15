"""Qwen3 (dense): the Llama block without q/k/v biases, with an RMSNorm over each head of q and k before RoPE
(`attn_q_norm`/`attn_k_norm` in a GGUF, `self_attn.q_norm`/`k_norm` in HF), and a head size of its own."""

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
    return {"qk_norm": True, "fused_stack": True}


def _hf_fields(c: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "fused_stack": True, "qkv_bias": bool(c.get("attention_bias", False))}


def _gguf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    sd = gguf_attention_mlp(t, config)
    sd["attn.q_norm.weight"] = t("attn_q_norm.weight")
    sd["attn.k_norm.weight"] = t("attn_k_norm.weight")
    return sd


def _hf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    sd = hf_attention_mlp(t, config)
    sd["attn.q_norm.weight"] = t("self_attn.q_norm.weight")
    sd["attn.k_norm.weight"] = t("self_attn.k_norm.weight")
    return sd


QWEN3 = Architecture(
    "qwen3",
    "Llama block with per-head q/k RMSNorm, no q/k/v bias",
    _fields,
    _gguf_layer,
    hf_model_types=("qwen3",),
    hf_config=_hf_fields,
    hf_layer=_hf_layer,
)
