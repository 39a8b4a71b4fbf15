"""Reading checkpoints into a ModelConfig and a state dict in the decoder's own naming.

Two formats: GGUF files (llama.cpp's; the header read by `gguf_file`, blocks dequantized by the `gguf` package) and
HuggingFace directories (config.json plus safetensors, sharded or not). Both end in float32 tensors
in the HuggingFace layout, which `Transformer` uses; asked to, a GGUF's quantized matrices are kept as their
blocks instead (`QuantizedWeight`), where the CPU kernels compute on that format.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.engine.kernels.quantized import QuantizedWeight, computable, row_bytes
from app.engine.model import architectures
from app.engine.model.architectures.base import WeightsError
from app.engine.model.config import ModelConfig
from app.engine.model.gguf_file import GGUFError, GGUFFile, GGUFTensor

__all__ = ["Checkpoint", "WeightsError", "check_shapes", "held_weights", "read_checkpoint"]

_GGUF_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q2_K", "Q3_K"}


@dataclass
class Checkpoint:
    """What a checkpoint holds: the decoder's shape, its weights, and what a tokenizer needs."""

    config: ModelConfig
    state_dict: dict[str, Tensor | QuantizedWeight]  # QuantizedWeight only where `quantized` was asked
    tokenizer_meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def read_checkpoint(path: Path, max_seq_len: int | None = None, quantized: bool = False) -> Checkpoint:
    """Read a GGUF file or an HF-format directory; raise WeightsError for anything else.

    `quantized`: a GGUF's matrices (projections, embedding, output) in a format the CPU kernels compute on
    stay `QuantizedWeight`s, as the file stores them; everything else is float32 as ever."""
    path = Path(path)
    if path.is_dir():
        return _read_hf(path, max_seq_len)
    if path.is_file():
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return _read_gguf(path, max_seq_len, quantized)
        raise WeightsError(f"{path} is neither a GGUF file nor an HF-format directory")
    raise WeightsError(f"{path} does not exist")


def check_shapes(ckpt: Checkpoint, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse (WeightsError, one line naming the file and the tensor) a checkpoint whose state dict is not
    exactly `expected`'s names and shapes (the decoder's parameters for `ckpt.config`), or whose quantized rows
    are not the bytes their format takes for their inputs. Torch checks the plain tensors it loads, but the C
    kernels take a quantized weight's sizes as given: a wrong one would be read and written past its buffers."""
    source = Path(ckpt.source).name
    missing = [name for name in expected if name not in ckpt.state_dict]
    unexpected = [name for name in ckpt.state_dict if name not in expected]
    if missing or unexpected:
        raise WeightsError(f"{source}: tensors missing {missing}, unexpected {unexpected}")
    for name, weight in ckpt.state_dict.items():
        want = tuple(expected[name])
        if tuple(weight.shape) != want:
            raise WeightsError(
                f"{source}: tensor {name} has shape {list(weight.shape)}; the model's config expects {list(want)}"
            )
        if isinstance(weight, QuantizedWeight):
            for qtype, data in weight.segments:
                try:
                    size = row_bytes(qtype, weight.in_features)
                except ValueError as exc:
                    raise WeightsError(f"{source}: tensor {name}: {exc}") from None
                if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != size:
                    raise WeightsError(
                        f"{source}: tensor {name} has {qtype} rows of {list(data.shape)[1:]} bytes; "
                        f"{weight.in_features} inputs take {size}"
                    )


def held_weights(path: Path, native: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[str, int]:
    """What `load_model` holds for the checkpoint at `path`, from its header alone: (what the weights run as,
    as `LoadedModel.weights` names it, and about the bytes they take). `native`: a GGUF's quantized matrices
    kept as their blocks where a kernel computes on them; everything else in `dtype`."""
    size = torch.empty(0, dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    path = Path(path)
    if path.is_dir():
        from safetensors import safe_open

        total = 0
        for shard in path.glob("*.safetensors"):
            with safe_open(str(shard), "np") as fh:
                total += sum(int(np.prod(fh.get_slice(k).get_shape())) for k in fh.keys())  # noqa: SIM118 (not a dict)
        return name, total * size
    reader = _open_gguf(path)
    formats: dict[str, None] = {}
    total, plain, kept = 0, False, set()
    for t in reader.tensors:
        count = int(np.prod([int(n) for n in t.shape]))
        matrix = len(t.shape) == 2
        if native and matrix and computable(t.tensor_type.name, int(t.shape[0])):
            formats[t.tensor_type.name] = None
            total += int(t.n_bytes)
            kept.add(t.name)
        else:
            total += count * size
            plain = plain or matrix
    head = "output.weight" if any(t.name == "output.weight" for t in reader.tensors) else "token_embd.weight"
    if head not in kept:  # the head is packed for the kernel beside the table or layer it comes from
        total += _count(reader, head) * size
    if not formats:
        return name, total
    return "+".join([*formats, *([name] if plain else [])]), total


def _count(reader: GGUFFile, tensor: str) -> int:
    return next(int(np.prod([int(n) for n in t.shape])) for t in reader.tensors if t.name == tensor)


# ---------------------------------------------------------------------------------------------- GGUF


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _checked(config: ModelConfig) -> ModelConfig:
    # Every size the decoder allocates by, from the file's metadata: positive, or nothing can be checked against it.
    sizes = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim", "max_seq_len")
    bad = [f"{name} {getattr(config, name)}" for name in sizes if getattr(config, name) <= 0]
    if bad:
        raise WeightsError(f"sizes must be positive, not {', '.join(bad)}")
    return config


def _open_gguf(path: Path) -> GGUFFile:
    # A truncated or malformed file fails inside struct or numpy; it is the file's fault, said in one line.
    try:
        return GGUFFile(path)
    except GGUFError as exc:
        raise WeightsError(str(exc)) from None
    except (ValueError, struct.error) as exc:
        raise WeightsError(f"{path.name}: not a GGUF this loader can read ({exc})") from None


def _gguf_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The shapes (rows first, as torch has them) a tensor of llama.cpp's naming may have for `config` (the
    file's own metadata), by its name within its layer; llama.cpp's loader checks each as strictly. Names not
    here are checked once assembled (`check_shapes`)."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {
        "token_embd.weight": ((c.vocab_size, c.dim),),
        "output.weight": ((c.vocab_size, c.dim),),
        "output_norm.weight": ((c.dim,),),
        "attn_q.weight": ((q, c.dim),),
        "attn_k.weight": ((kv, c.dim),),
        "attn_v.weight": ((kv, c.dim),),
        "attn_qkv.weight": ((q + 2 * kv, c.dim),),
        "attn_q.bias": ((q,),),
        "attn_k.bias": ((kv,),),
        "attn_v.bias": ((kv,),),
        "attn_output.weight": ((c.dim, q),),
        "attn_q_norm.weight": ((c.head_dim,),),
        "attn_k_norm.weight": ((c.head_dim,),),
        "attn_norm.weight": ((c.dim,),),
        "ffn_norm.weight": ((c.dim,),),
        "post_attention_norm.weight": ((c.dim,),),
        "post_ffw_norm.weight": ((c.dim,),),
        "ffn_gate.weight": ((c.intermediate_size, c.dim),),
        # Phi-3 stores gate and up as one ffn_up.
        "ffn_up.weight": ((c.intermediate_size, c.dim), (2 * c.intermediate_size, c.dim)),
        "ffn_down.weight": ((c.dim, c.intermediate_size),),
    }


def _layer(
    path: Path, i: int, build: Callable[[Any, ModelConfig], dict[str, Any]], tensors: Any, config: ModelConfig
) -> dict[str, Any]:
    """Layer `i`'s tensors as an architecture's layer function `build` assembles them from `tensors`, with a
    tensor that does not fit the others (a reshape or a join that torch or `QuantizedWeight` refuses) said as the
    file's fault."""
    try:
        return build(tensors, config)
    except WeightsError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise WeightsError(f"{path.name}: layer {i}'s tensors do not fit together: {exc}") from None


class _GGUFMeta:
    """The metadata and tensor names of a GGUF, as an architecture module reads them (`base.Meta`)."""

    def __init__(self, reader: GGUFFile, arch: str, tensors: dict[str, GGUFTensor]) -> None:
        self._reader, self._arch, self._tensors = reader, arch, tensors

    def __call__(self, key: str, default: Any = None) -> Any:
        return _field(self._reader, f"{self._arch}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors


class _Tensors:
    """One layer's tensors of a GGUF (`blk.{i}.` + name; `base.Layer`), or the file's own (prefix "")."""

    def __init__(self, load: Any, tensors: dict[str, Any], prefix: str) -> None:
        self._load, self._tensors, self._prefix = load, tensors, prefix

    def __call__(self, name: str, matrix: bool = False) -> Tensor | QuantizedWeight:
        return self._load(self._prefix + name, matrix)

    def has(self, name: str) -> bool:
        return self._prefix + name in self._tensors


def _read_gguf(path: Path, max_seq_len: int | None, quantized: bool = False) -> Checkpoint:
    import gguf

    reader = _open_gguf(path)
    arch = _field(reader, "general.architecture")
    entry = architectures.gguf(arch, path.name)

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    dim = int(meta("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(meta("vocab_size", len(tokens) if tokens else tensors["token_embd.weight"].shape[-1]))
    ctx = int(meta("context_length", 4096))
    rope_scaling = None
    if "rope_freqs.weight" in tensors:
        # Llama 3.1 GGUFs carry the per-frequency divisors llama.cpp computed at conversion.
        factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in np.ravel(factors)]}
    elif meta("rope.scaling.type") == "linear" and meta("rope.scaling.factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif meta("rope.scaling.type") not in (None, "none", "linear"):
        # Silently ignoring it (YaRN, ...) would give wrong logits at every position.
        raise WeightsError(f"{path.name}: RoPE scaling {meta('rope.scaling.type')!r} is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "dim": dim,
        "n_layers": int(meta("block_count")),
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "intermediate_size": int(meta("feed_forward_length")),
        "head_dim": int(meta("attention.key_length", meta("rope.dimension_count", dim // n_heads))),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "max_seq_len": min(ctx, max_seq_len) if max_seq_len else ctx,
        "rope_scaling": rope_scaling,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_ids": (int(eos),) if eos is not None else (),
        "architecture": entry.name,
    }
    try:
        config = _checked(ModelConfig(**{**common, **entry.gguf_config(_GGUFMeta(reader, arch, tensors), common)}))
    except ValueError as exc:  # WeightsError too
        raise WeightsError(f"{path.name}: {exc}") from None

    shapes = _gguf_shapes(config)

    def load(name: str, matrix: bool = False) -> Tensor | QuantizedWeight:
        if name not in tensors:
            raise WeightsError(f"{path.name}: no tensor {name}, which a {arch} layer has")
        t = tensors[name]
        qtype = t.tensor_type.name
        if qtype not in _GGUF_TYPES:
            raise WeightsError(f"{path.name}: tensor {name} has type {qtype}, which this loader cannot read")
        shape = tuple(int(n) for n in reversed(t.shape))
        allowed = shapes.get(name.split(".", 2)[2] if name.startswith("blk.") else name)
        if allowed is not None and shape not in allowed:
            want = " or ".join(str(list(a)) for a in allowed)
            raise WeightsError(f"{path.name}: tensor {name} has shape {list(shape)}; the model's config expects {want}")
        if quantized and matrix and len(t.shape) == 2 and computable(qtype, int(t.shape[0])):
            # The file's blocks, copied out of the memory map: [rows, bytes per row].
            return QuantizedWeight([(qtype, torch.from_numpy(np.array(t.data, dtype=np.uint8)))], int(t.shape[0]))
        arr = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    sd: dict[str, Tensor | QuantizedWeight] = {
        "embed.weight": load("token_embd.weight", matrix=True),
        "norm.weight": load("output_norm.weight"),
    }
    if not config.tie_embeddings:
        sd["lm_head.weight"] = load("output.weight", matrix=True)
    for i in range(config.n_layers):
        layer = _layer(path, i, entry.gguf_layer, _Tensors(load, tensors, f"blk.{i}."), config)
        sd.update({f"layers.{i}.{name}": w for name, w in layer.items()})

    return Checkpoint(config, sd, _tokenizer_meta(reader, arch), source=str(path))


def read_tokenizer_meta(path: Path) -> dict[str, Any]:
    """A GGUF file's tokenizer metadata alone (`Checkpoint.tokenizer_meta`), without reading its weights."""
    reader = _open_gguf(Path(path))
    return _tokenizer_meta(reader, _field(reader, "general.architecture"))


def _tokenizer_meta(reader: GGUFFile, arch: str) -> dict[str, Any]:
    return {
        "format": "gguf",
        "architecture": arch,
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "scores": _field(reader, "tokenizer.ggml.scores"),
        "token_type": _field(reader, "tokenizer.ggml.token_type"),
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "unk_token_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


# ------------------------------------------------------------------------------------------------ HF


def _hf_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{path}: no safetensors weights found")
    sd: dict[str, Tensor] = {}
    for shard in shards:
        sd.update(load_file(str(path / shard)))
    return sd


class _HFLayer:
    """One layer's tensors of an HF checkpoint (`model.layers.{i}.` + name; `base.Layer`), float32."""

    def __init__(self, raw: dict[str, Tensor], prefix: str, source: Path) -> None:
        self._raw, self._prefix, self._source = raw, prefix, source

    def __call__(self, name: str, matrix: bool = False) -> Tensor:
        if self._prefix + name not in self._raw:
            raise WeightsError(f"{self._source}: no tensor {self._prefix + name}")
        return self._raw[self._prefix + name]

    def has(self, name: str) -> bool:
        return self._prefix + name in self._raw


class _ReadTensors(dict):
    """A checkpoint's tensors by name, remembering which were read (`read`)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Tensor:
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        if name in self:
            self.read.add(name)
        return super().get(name, default)


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors an HF checkpoint may hold that carry nothing the decoder lacks: RoPE's frequencies (computed here), a
    tied head's copy of the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings)


def _read_hf(path: Path, max_seq_len: int | None) -> Checkpoint:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise WeightsError(f"{path}: no config.json, so not an HF-format model directory")
    c = json.loads(cfg_path.read_text())
    arch = c.get("model_type")
    entry = architectures.hf(arch, str(path))
    rope = c.get("rope_parameters") or {}
    rope_theta = float(c.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    # "dynamic" only departs from plain RoPE past max_position_embeddings, which is also our context limit.
    if rope_kind not in (None, "default", "linear", "llama3", "dynamic"):
        raise WeightsError(f"{path}: RoPE scaling {rope_kind!r} is not supported (supported: linear, llama3)")
    n_heads = int(c["num_attention_heads"])
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    ctx = int(c.get("max_position_embeddings", 4096))
    common: dict[str, Any] = {
        "vocab_size": int(c["vocab_size"]),
        "dim": int(c["hidden_size"]),
        "n_layers": int(c["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": int(c.get("num_key_value_heads") or n_heads),
        "intermediate_size": int(c["intermediate_size"]),
        "head_dim": int(c.get("head_dim") or c["hidden_size"] // n_heads),
        "rope_theta": rope_theta,
        "norm_eps": float(c.get("rms_norm_eps", 1e-5)),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "max_seq_len": min(ctx, max_seq_len) if max_seq_len else ctx,
        "rope_scaling": rope_scaling,
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "architecture": entry.name,
    }
    assert entry.hf_config is not None and entry.hf_layer is not None  # every entry with model types has them
    try:
        config = _checked(ModelConfig(**{**common, **entry.hf_config(c, common)}))
    except ValueError as exc:  # WeightsError too
        raise WeightsError(f"{path}: {exc}") from None
    raw = {k: v.float() for k, v in _hf_tensors(path).items()}
    if entry.norm_offset:
        # Stored as w for a norm that multiplies by offset + w (Gemma): the block multiplies by the sum.
        raw = {k: v + entry.norm_offset if k.rsplit(".", 2)[-2].endswith("norm") else v for k, v in raw.items()}
    raw = _ReadTensors(raw)
    sd: dict[str, Tensor] = {
        "embed.weight": raw["model.embed_tokens.weight"],
        "norm.weight": raw["model.norm.weight"],
    }
    if not config.tie_embeddings:
        sd["lm_head.weight"] = raw.get("lm_head.weight", raw["model.embed_tokens.weight"])
    for i in range(config.n_layers):
        layer = _layer(path, i, entry.hf_layer, _HFLayer(raw, f"model.layers.{i}.", path), config)
        sd.update({f"layers.{i}.{name}": w for name, w in layer.items()})  # type: ignore[misc]
    # A tensor the decoder never reads is a computation it leaves out (an o_proj bias where `attention_bias` also
    # gives one, MLP biases): the logits would be silently wrong, so the checkpoint is refused.
    unread = sorted(name for name in raw if name not in raw.read and not _ignorable(name, config))
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise WeightsError(f"{path}: tensors this {entry.name} decoder does not compute with: {shown}")
    tokenizer_meta: dict[str, Any] = {"format": "hf", "path": str(path)}
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.exists():
        tokenizer_meta["config"] = json.loads(tok_cfg.read_text())
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if g is not None:
            extra = tuple(g) if isinstance(g, list) else (g,)
            config = ModelConfig.from_dict({**config.to_dict(), "eos_token_ids": tuple(dict.fromkeys(eos_ids + extra))})
    return Checkpoint(config, sd, tokenizer_meta, source=str(path))
