"""Gemma 2 and Gemma 3 (text): the Llama block's attention and gated MLP with

- a norm on the attention's output and on the MLP's output too, before each residual add (`post_attention_norm`,
  `post_ffw_norm`; the MLP's input norm is `ffn_norm`, HF's `pre_feedforward_layernorm`);
- RMSNorm multiplying by `1 + w`: llama.cpp's converter stores `1 + w`, HF stores `w` (`norm_offset`);
- GeGLU (tanh GELU) instead of SwiGLU, and embeddings scaled by sqrt(dim);
- sliding-window layers beside global ones: Gemma 2 every other layer (the even ones), Gemma 3 five of every six,
  whose RoPE base is `rope.freq_base_swa` (10000, as llama.cpp defaults it);
- queries scaled by query_pre_attn_scalar ** -0.5: in a GGUF the head size, except in the 27B models, where llama.cpp
  takes dim / heads (the GGUF does not store it);
- Gemma 2: attention logits and final logits soft-capped (`attn_logit_softcapping` 50, `final_logit_softcapping`
  30 unless the file says); Gemma 3: an RMSNorm over each head of q and k instead.
"""

from __future__ import annotations

import math
from typing import Any

from app.engine.model.architectures.base import Architecture, Layer, Meta, Weight, cat
from app.engine.model.config import ModelConfig

# Where llama.cpp takes query_pre_attn_scalar = dim / heads: the 27B models, by their layer count.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _sliding(n_layers: int, pattern: Any) -> tuple[int, ...]:
    if isinstance(pattern, list | tuple):  # one flag per layer
        return tuple(i for i, on in enumerate(pattern) if on)
    return tuple(i for i in range(n_layers) if (i + 1) % int(pattern))


def _common(name: str, common: dict[str, Any], window: int, sliding: tuple[int, ...], scalar: float) -> dict:
    return {
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "embed_scale": math.sqrt(common["dim"]),
        "attn_scale": 0.0 if scalar == common["head_dim"] else scalar**-0.5,
        "sliding_window": window if sliding else 0,
        "sliding_layers": sliding if window else (),
    }


def _gguf_fields(name: str, pattern: int) -> Any:
    def fields(meta: Meta, common: dict[str, Any]) -> dict[str, Any]:
        n_layers = common["n_layers"]
        big = n_layers == _27B_LAYERS[name]
        scalar = common["dim"] / common["n_heads"] if big else common["head_dim"]
        window = int(meta("attention.sliding_window", 0) or 0)
        sliding = _sliding(n_layers, meta("attention.sliding_window_pattern", pattern))
        out = _common(name, common, window, sliding, scalar)
        if name == "gemma2":
            out["attn_softcap"] = float(meta("attn_logit_softcapping", 50.0) or 0.0)
            out["final_softcap"] = float(meta("final_logit_softcapping", 30.0) or 0.0)
        else:
            out["qk_norm"] = True
            out["rope_local_theta"] = float(meta("rope.freq_base_swa", 10000.0))
            out["fused_stack"] = not out["attn_scale"]  # the stack's attention scales by 1 / sqrt(head_dim)
        return out

    return fields


def _hf_fields(name: str, pattern: int) -> Any:
    def fields(c: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
        n_layers = common["n_layers"]
        window = int(c.get("sliding_window") or 0)
        types = c.get("layer_types")
        if types:
            sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            sliding = _sliding(n_layers, c.get("sliding_window_pattern", pattern))
        scalar = float(c.get("query_pre_attn_scalar") or common["head_dim"])
        out = _common(name, common, window, sliding, scalar)
        if name == "gemma2":
            out["attn_softcap"] = float(c.get("attn_logit_softcapping") or 0.0)
            out["final_softcap"] = float(c.get("final_logit_softcapping") or 0.0)
            return out
        out["qk_norm"] = True
        out["fused_stack"] = not out["attn_scale"]  # the stack's attention scales by 1 / sqrt(head_dim)
        out["final_softcap"] = float(c.get("final_logit_softcapping") or 0.0)
        rope = c.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: one RoPE per layer type
            full, local = rope["full_attention"], rope.get("sliding_attention", {})
            out["rope_theta"] = float(full.get("rope_theta", common["rope_theta"]))
            out["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
            kind = full.get("rope_type", "default")
            out["rope_scaling"] = None if kind == "default" else dict(full)
        else:
            out["rope_local_theta"] = float(c.get("rope_local_base_freq", 10000.0))
        return out

    return fields


def _gguf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    sd: dict[str, Weight] = {"attn.wqkv.weight": cat([t(f"attn_{n}.weight", matrix=True) for n in "qkv"])}
    sd["attn.wo.weight"] = t("attn_output.weight", matrix=True)
    sd["attn_norm.weight"] = t("attn_norm.weight")
    sd["post_attn_norm.weight"] = t("post_attention_norm.weight")
    sd["ffn_norm.weight"] = t("ffn_norm.weight")
    sd["post_ffn_norm.weight"] = t("post_ffw_norm.weight")
    sd["w13.weight"] = cat([t("ffn_gate.weight", matrix=True), t("ffn_up.weight", matrix=True)])
    sd["w2.weight"] = t("ffn_down.weight", matrix=True)
    if config.qk_norm:
        sd["attn.q_norm.weight"] = t("attn_q_norm.weight")
        sd["attn.k_norm.weight"] = t("attn_k_norm.weight")
    return sd


def _hf_layer(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    attn = "self_attn."
    sd: dict[str, Weight] = {"attn.wqkv.weight": cat([t(f"{attn}{n}_proj.weight") for n in "qkv"])}
    sd["attn.wo.weight"] = t(attn + "o_proj.weight")
    sd["attn_norm.weight"] = t("input_layernorm.weight")
    sd["post_attn_norm.weight"] = t("post_attention_layernorm.weight")
    sd["ffn_norm.weight"] = t("pre_feedforward_layernorm.weight")
    sd["post_ffn_norm.weight"] = t("post_feedforward_layernorm.weight")
    sd["w13.weight"] = cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")])
    sd["w2.weight"] = t("mlp.down_proj.weight")
    if config.qk_norm:
        sd["attn.q_norm.weight"] = t(attn + "q_norm.weight")
        sd["attn.k_norm.weight"] = t(attn + "k_norm.weight")
    return sd


GEMMA2 = Architecture(
    "gemma2",
    "Gemma 2: sandwich norms, GeGLU, scaled embeddings, alternating sliding-window layers, logit soft-capping",
    _gguf_fields("gemma2", 2),
    _gguf_layer,
    hf_model_types=("gemma2",),
    hf_config=_hf_fields("gemma2", 2),
    hf_layer=_hf_layer,
    norm_offset=1.0,
)
GEMMA3 = Architecture(
    "gemma3",
    "Gemma 3 (text): Gemma 2's block with q/k norms instead of soft-capping, 5 sliding layers in 6 with a local RoPE",
    _gguf_fields("gemma3", 6),
    _gguf_layer,
    hf_model_types=("gemma3_text",),
    hf_config=_hf_fields("gemma3", 6),
    hf_layer=_hf_layer,
    norm_offset=1.0,
)
