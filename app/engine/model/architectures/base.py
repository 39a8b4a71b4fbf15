"""What every architecture module builds on: its registry entry (`Architecture`) and the views of a checkpoint it
reads (`Meta` for GGUF metadata, `Layer` for one layer's tensors), plus the tensor helpers several share.

An architecture gives the `ModelConfig` fields it sets beyond the ones every checkpoint states (shape, RoPE base,
norm epsilon, vocabulary; read in `app.engine.model.weights`), and each layer's tensors in the decoder's own
names (`layers.{i}.` + `attn.wqkv.weight`, `attn.wo.weight`, `attn_norm.weight`, `ffn_norm.weight`,
`w13.weight` (gate then up), `w2.weight`, and where its block has them `attn.wqkv.bias`, `attn.q_norm.weight`,
`attn.k_norm.weight`, `post_attn_norm.weight`, `post_ffn_norm.weight`). Norm weights are what the block multiplies
by: a checkpoint that stores `w` for a `1 + w` norm (Gemma's HF weights) has `norm_offset` 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from app.engine.kernels.quantized import QuantizedWeight
from app.engine.model.config import ModelConfig

Weight = Tensor | QuantizedWeight


class WeightsError(ValueError):
    """A checkpoint this engine cannot use; the message says why in one line."""


class Meta(Protocol):
    """A GGUF's metadata as an architecture reads it."""

    def __call__(self, key: str, default: Any = None) -> Any:
        """The value of `{architecture}.{key}`, or `default`."""

    def has_tensor(self, name: str) -> bool: ...


class Layer(Protocol):
    """One layer's tensors, by their name within the layer (`attn_q.weight` in a GGUF, `self_attn.q_proj.weight`
    in an HF checkpoint)."""

    def __call__(self, name: str, matrix: bool = False) -> Weight:
        """The tensor (`matrix`: a product's weight, which a GGUF may keep quantized)."""

    def has(self, name: str) -> bool: ...


@dataclass(frozen=True)
class Architecture:
    """One architecture: its GGUF name, the HF `model_type`s it reads, what its block does (as config fields) and
    where its tensors are. `gguf_config(meta, common)` and `hf_config(config_json, common)` return the
    `ModelConfig` fields to set over the common ones (`common`: those, as read); `gguf_layer(layer, config)` and
    `hf_layer(layer, config)` one layer's tensors in the decoder's names."""

    name: str
    description: str
    gguf_config: Callable[[Meta, dict[str, Any]], dict[str, Any]]
    gguf_layer: Callable[[Layer, ModelConfig], dict[str, Weight]]
    hf_model_types: tuple[str, ...] = ()
    hf_config: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    hf_layer: Callable[[Layer, ModelConfig], dict[str, Weight]] | None = None
    norm_offset: float = 0.0  # added to an HF checkpoint's norm weights


def unpermute_rope(w: Weight, n_heads: int) -> Weight:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to HF's rotate-half order."""
    out = w.shape[0]
    if isinstance(w, QuantizedWeight):  # whole rows move: the blocks of a row stay as they are
        return w.permute_rows(unpermute_rope(torch.arange(out), n_heads))  # type: ignore[arg-type]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def cat(parts: list[Weight]) -> Weight:
    """Rows of `parts` one after another: quantized if every part is (a fused projection of mixed kinds is
    dequantized whole)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


def gguf_attention_mlp(t: Layer, config: ModelConfig, permuted: bool = False) -> dict[str, Weight]:
    """A Llama layer as llama.cpp's converter writes it: attn_q/k/v (rows permuted for interleaved RoPE where
    `permuted`), attn_output, attn_norm, ffn_norm, ffn_gate/up/down; the q/k/v biases where the config has them."""
    q, k, v = (t(f"attn_{n}.weight", matrix=True) for n in "qkv")
    if permuted:
        q, k = unpermute_rope(q, config.n_heads), unpermute_rope(k, config.n_kv_heads)
    sd: dict[str, Weight] = {"attn.wqkv.weight": cat([q, k, v])}
    if config.qkv_bias:
        sd["attn.wqkv.bias"] = torch.cat([t(f"attn_{n}.bias") for n in "qkv"])  # type: ignore[misc]
    sd["attn.wo.weight"] = t("attn_output.weight", matrix=True)
    sd["attn_norm.weight"] = t("attn_norm.weight")
    sd["ffn_norm.weight"] = t("ffn_norm.weight")
    sd["w13.weight"] = cat([t("ffn_gate.weight", matrix=True), t("ffn_up.weight", matrix=True)])
    sd["w2.weight"] = t("ffn_down.weight", matrix=True)
    return sd


def hf_attention_mlp(t: Layer, config: ModelConfig) -> dict[str, Weight]:
    """A Llama layer as HF names it (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm, and
    post_attention_layernorm as the MLP's norm)."""
    attn = "self_attn."
    sd: dict[str, Weight] = {"attn.wqkv.weight": cat([t(f"{attn}{n}_proj.weight") for n in "qkv"])}
    if config.qkv_bias:
        sd["attn.wqkv.bias"] = cat([t(f"{attn}{n}_proj.bias") for n in "qkv"])
    sd["attn.wo.weight"] = t(attn + "o_proj.weight")
    sd["attn_norm.weight"] = t("input_layernorm.weight")
    sd["ffn_norm.weight"] = t("post_attention_layernorm.weight")
    sd["w13.weight"] = cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")])
    sd["w2.weight"] = t("mlp.down_proj.weight")
    return sd
