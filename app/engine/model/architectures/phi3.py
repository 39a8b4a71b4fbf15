"""Phi-3 (mini/medium, 4k context): the Llama block with q/k/v and gate/up stored fused, as the file has them
(`attn_qkv`, and `ffn_up` holding gate then up; HF's `qkv_proj`, `gate_up_proj`), rotate-half RoPE in the file.
Every layer slides where the file gives a window. LongRoPE (the 128k models' `rope_factors_*`) and a partial rotary
(Phi-4-mini) are refused."""

from __future__ import annotations

from typing import Any

from app.engine.model.architectures.base import Architecture, Layer, Meta, Weight, WeightsError, cat
from app.engine.model.config import ModelConfig


def _fields(meta: Meta, common: dict[str, Any]) -> dict[str, Any]:
    if meta.has_tensor("rope_factors_long.weight") or meta.has_tensor("rope_factors_short.weight"):
        raise WeightsError("phi3: LongRoPE (rope_factors_long/short, the 128k models) is not supported")
    head_dim = common["dim"] // common["n_heads"]
    rotary = meta("rope.dimension_count", head_dim)
    if int(rotary) != head_dim:
        raise WeightsError(f"phi3: a partial rotary ({rotary} of {head_dim} dimensions) is not supported")
    window = int(meta("attention.sliding_window", 0) or 0)
    sliding = tuple(range(common["n_layers"]))
    return {"head_dim": head_dim, "sliding_window": window, "sliding_layers": sliding, "fused_stack": True}


def _hf_fields(c: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    if float(c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise WeightsError("phi3: a partial rotary is not supported")
    window = int(c.get("sliding_window") or 0)
    sliding = tuple(range(common["n_layers"])) if window else ()
    return {"sliding_window": window, "sliding_layers": sliding, "fused_stack": True}


def _gguf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    if t.has("attn_qkv.weight"):
        qkv = t("attn_qkv.weight", matrix=True)
    else:
        qkv = cat([t(f"attn_{n}.weight", matrix=True) for n in "qkv"])
    return {
        "attn.wqkv.weight": qkv,
        "attn.wo.weight": t("attn_output.weight", matrix=True),
        "attn_norm.weight": t("attn_norm.weight"),
        "ffn_norm.weight": t("ffn_norm.weight"),
        "w13.weight": t("ffn_up.weight", matrix=True),
        "w2.weight": t("ffn_down.weight", matrix=True),
    }


def _hf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    return {
        "attn.wqkv.weight": t("self_attn.qkv_proj.weight"),
        "attn.wo.weight": t("self_attn.o_proj.weight"),
        "attn_norm.weight": t("input_layernorm.weight"),
        "ffn_norm.weight": t("post_attention_layernorm.weight"),
        "w13.weight": t("mlp.gate_up_proj.weight"),
        "w2.weight": t("mlp.down_proj.weight"),
    }


PHI3 = Architecture(
    "phi3",
    "Llama block with fused q/k/v and gate/up projections",
    _fields,
    _gguf_layer,
    hf_model_types=("phi3",),
    hf_config=_hf_fields,
    hf_layer=_hf_layer,
)
