"""What a decoder is, as the forward needs it: its shape and numerics (`ModelConfig`), and which of its block's
features the C layer stack runs. Which architecture sets which fields is its module in
`app.engine.model.architectures`; nothing here knows about files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")
# What a block may do beyond Llama's and still run in the C layer stack (layers.h's sk_layer_t; the embeddings'
# scale and the logits' soft-capping lie outside the layers).
STACK_FEATURES = frozenset(
    {
        "q/k norms",
        "post-attention and post-MLP norms",
        "GeGLU",
        "scaled embeddings",
        "final logit soft-capping",
        "sliding-window layers",
        "a local RoPE base",
    }
)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder; everything the forward needs, nothing about files."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_seq_len: int = 4096
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # What a block does beyond Llama's (the defaults are Llama's; an architecture's module sets the rest).
    architecture: str = "llama"
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm on the attention's and on the MLP's output too, before the residual add
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim), rounded to the activations' dtype)
    attn_scale: float = 0.0  # scores times this; 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax; 0: none (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits (Gemma 2)
    sliding_window: int = 0  # the layers in `sliding_layers` attend their last `sliding_window` positions only
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0  # the sliding layers' RoPE base, without scaling (Gemma 3); 0: rope_theta
    # Whether the C layer stack (one kernel call for every layer) may run this model: an architecture opts in,
    # and only a block whose every feature the stack runs can (STACK_FEATURES; not a query scale nor soft-capped
    # attention).
    fused_stack: bool = False

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        if self.fused_stack and self.beyond_stack():
            raise ValueError(f"the C layer stack does not run {', '.join(self.beyond_stack())}")

    def block_features(self) -> list[str]:
        """What this block does that a plain Llama block does not (empty for the Llama family)."""
        features = {
            "q/k norms": self.qk_norm,
            "post-attention and post-MLP norms": self.sandwich_norms,
            "GeGLU": self.activation == "gelu_tanh",
            "scaled embeddings": self.embed_scale != 1.0,
            "a query scale": self.attn_scale != 0.0,
            "attention soft-capping": self.attn_softcap != 0.0,
            "final logit soft-capping": self.final_softcap != 0.0,
            "sliding-window layers": bool(self.sliding_window and self.sliding_layers),
            "a local RoPE base": self.rope_local_theta != 0.0,
        }
        return [name for name, on in features.items() if on]

    def beyond_stack(self) -> list[str]:
        """The block's features the C layer stack does not run (`STACK_FEATURES`); empty where it may run it."""
        return [f for f in self.block_features() if f not in STACK_FEATURES]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        return cls(**d)
