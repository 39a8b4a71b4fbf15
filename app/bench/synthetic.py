"""Synthetic targets: a bigger model's shape with random weights, written as a GGUF, to time decoding at sizes
the catalog does not ship (`specserve bench --synthetic`).

Random weights show speed, never acceptance: what a draft guesses right depends on what the target learned.
The file is a llama-architecture GGUF as llama.cpp's converter lays it out (tensor names, order, metadata),
with the default target's tokenizer metadata copied in, so that our loader (`--weights native` included)
and llama.cpp both load it. Every matrix is random valid blocks of its format, written straight as bytes
(gguf cannot quantize the K-quants; for Q8_0 the same is faster than quantizing random floats): random quant
bytes, and float16 block scales set so that the weights' values have about `SIGMA`'s spread (a trained
model's init scale, which keeps activations finite through the layers). Norm weights are ones. The writer
streams: one tensor's bytes in memory at a time, so a 2 GB file needs little more than its largest tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where used: the CLI reads SHAPES and FORMATS for its choices
    import numpy as np

SIGMA = 0.02  # the weights' standard deviation (Llama's init)


@dataclass(frozen=True)
class Shape:
    """A llama-architecture decoder's shape, as a GGUF's `llama.*` fields give it (embeddings tied)."""

    label: str
    n_layers: int
    dim: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int = 49152  # SmolLM2's tokenizer (the default target's, copied into the file)
    context: int = 8192
    rope_theta: float = 130000.0
    norm_eps: float = 1e-5


# SmolLM2-1.7B(-Instruct)'s config.json: 24 layers, hidden 2048, intermediate 8192, 32 heads and KV heads.
SHAPES = {"1.7b": Shape("SmolLM2-1.7B", 24, 2048, 8192, 32, 32, 64)}

# File formats: (llama.cpp's general.file_type, the layers' main type). `q4_k_m` follows llama.cpp's Q4_K_M
# recipe: Q4_K matrices, Q6_K for the tied embedding (it is the output layer) and for attn_v and ffn_down in
# the layers llama.cpp gives more bits (the first and last eighth, every third between).
FORMATS = {"q8_0": (7, "Q8_0"), "q4_k_m": (15, "Q4_K")}

# Per block type: (inputs, bytes, [(offset of a float16 scale, its multiple of the base scale)], the standard
# deviation of a block's value in units of the base scale when every other byte is uniformly random).
# Q8_0: d, 32 int8 (std 73.9). Q4_K: d, dmin, 12 bytes of 6-bit scales and mins (0..63), 128 bytes of 4-bit
# quants: value d*sc*q - dmin*m, spread about 218 d; dmin = 7.5 d centres it (mean sc*q 236, mean m 31.5).
# Q6_K: 128 + 64 bytes of 6-bit quants (q - 32), 16 int8 scales, d last: value d*sc*(q - 32), spread 1367 d.
_BLOCKS: dict[str, tuple[int, int, list[tuple[int, float]], float]] = {
    "Q8_0": (32, 34, [(0, 1.0)], 73.9),
    "Q4_K": (256, 144, [(0, 1.0), (2, 7.5)], 218.0),
    "Q6_K": (256, 210, [(208, 1.0)], 1367.0),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape, fmt: str) -> list[tuple[str, tuple[int, ...], str]]:
    """The file's tensors in llama.cpp's order: (GGUF name, shape as [rows, inputs] or [n], GGML type)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown synthetic format {fmt!r}; choose {', '.join(FORMATS)}")
    main = FORMATS[fmt][1]
    k_quants = fmt == "q4_k_m"
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (shape.vocab, shape.dim), "Q6_K" if k_quants else main)
    ]
    for i in range(shape.n_layers):
        more = "Q6_K" if k_quants and _more_bits(i, shape.n_layers) else main
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (shape.dim,), "F32"),
            (p + "attn_q.weight", (q, shape.dim), main),
            (p + "attn_k.weight", (kv, shape.dim), main),
            (p + "attn_v.weight", (kv, shape.dim), more),
            (p + "attn_output.weight", (shape.dim, q), main),
            (p + "ffn_norm.weight", (shape.dim,), "F32"),
            (p + "ffn_gate.weight", (shape.intermediate, shape.dim), main),
            (p + "ffn_up.weight", (shape.intermediate, shape.dim), main),
            (p + "ffn_down.weight", (shape.dim, shape.intermediate), more),
        ]
    plan.append(("output_norm.weight", (shape.dim,), "F32"))
    for name, dims, qtype in plan:
        if qtype in _BLOCKS and dims[-1] % _BLOCKS[qtype][0]:
            raise ValueError(f"{name}: rows of {dims[-1]} inputs are not whole {qtype} blocks")
    return plan


def random_tensor(qtype: str, dims: tuple[int, ...], rng: np.random.Generator, sigma: float = SIGMA) -> np.ndarray:
    """A tensor's data as the file stores it: float32 ones for `F32` (norms), else uint8 [rows, bytes per row]
    of random valid `qtype` blocks whose values spread about `sigma`."""
    import numpy as np

    if qtype == "F32":
        return np.ones(dims, dtype=np.float32)
    qk, size, scales, spread = _BLOCKS[qtype]
    rows, inputs = dims
    raw = rng.integers(0, 256, (rows, inputs // qk, size), dtype=np.uint8)
    base = rng.uniform(0.5, 1.5, (rows, inputs // qk, 1)) * (sigma / spread)
    for offset, multiple in scales:
        raw[:, :, offset : offset + 2] = (base * multiple).astype("<f2").view(np.uint8)
    return raw.reshape(rows, -1)


def _add_shape(writer: object, shape: Shape | TinyShape, context: int) -> None:
    """A decoder's shape as the `{arch}.*` fields llama.cpp writes (head size as the RoPE dimension count)."""
    w = writer
    w.add_context_length(context)  # type: ignore[attr-defined]
    w.add_embedding_length(shape.dim)  # type: ignore[attr-defined]
    w.add_block_count(shape.n_layers)  # type: ignore[attr-defined]
    w.add_feed_forward_length(shape.intermediate)  # type: ignore[attr-defined]
    w.add_head_count(shape.n_heads)  # type: ignore[attr-defined]
    w.add_head_count_kv(shape.n_kv_heads)  # type: ignore[attr-defined]
    w.add_rope_freq_base(shape.rope_theta)  # type: ignore[attr-defined]
    w.add_layer_norm_rms_eps(shape.norm_eps)  # type: ignore[attr-defined]
    w.add_rope_dimension_count(shape.head_dim)  # type: ignore[attr-defined]


def write_gguf(path: Path, shape: Shape, fmt: str, tokenizer_from: Path, seed: int = 0, progress: bool = False) -> Path:
    """Write a `fmt` GGUF of `shape` with random weights at `path`, tensor by tensor (through `path`.partial,
    renamed at the end: an interrupted write leaves no file). The tokenizer metadata comes from the GGUF
    `tokenizer_from` (its vocabulary must be `shape.vocab` tokens). Returns `path`."""
    import gguf
    import numpy as np

    from app.engine.model.gguf_file import GGUFFile

    plan = tensor_plan(shape, fmt)
    source = GGUFFile(tokenizer_from)
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) != shape.vocab:
        raise ValueError(f"{tokenizer_from} holds no tokenizer of {shape.vocab} tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"{shape.label} shape, random weights ({fmt}, specserve synthetic)")
    writer.add_file_type(FORMATS[fmt][0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_shape(writer, shape, shape.context)
    writer.add_vocab_size(shape.vocab)
    for name, value in source.fields.items():
        if name.startswith("tokenizer."):
            vtype, sub = source.types[name]
            writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, dims, qtype in plan:
        if qtype == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            qk, size = _BLOCKS[qtype][:2]
            nbytes = dims[0] * dims[1] // qk * size
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(plan), desc=f"writing {path.name}", unit="tensor", file=sys.stderr)
    try:
        for _, dims, qtype in plan:
            writer.write_tensor_data(random_tensor(qtype, dims, rng))
            if bar is not None:
                bar.update()
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    tmp.replace(path)
    return path


def synthetic_path(directory: Path, name: str, fmt: str) -> Path:
    """Where `ensure` keeps shape `name`'s `fmt` file: `directory`/synthetic/smollm2-NAME-random.FMT.gguf."""
    return directory / "synthetic" / f"smollm2-{name}-random.{fmt}.gguf"


def ensure(name: str, fmt: str, directory: Path, tokenizer_from: Path, progress: bool = True) -> Path:
    """Shape `name`'s (`SHAPES`) synthetic target in `fmt`, written once under `directory` (the model store's
    cache directory) and reused after; delete the file to write it again."""
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic shape {name!r}; choose {', '.join(SHAPES)}")
    path = synthetic_path(directory, name, fmt)
    if not path.exists():
        write_gguf(path, SHAPES[name], fmt, tokenizer_from, progress=progress)
    return path


# ------------------------------------------------------------------------------------ tiny models, per architecture

# Tiny random-weight models of each architecture the decoder runs besides Llama, written as llama.cpp's converter
# lays them out (float32 tensors, its tensor names and metadata keys) with a vocabulary of their kind, so that
# transformers' GGUF loader reads the same file: the architectures' oracle tests (tests/test_architectures.py).
# Every weight is a bfloat16 value (rounded so), so that a bfloat16 copy holds the very same weights.

# Text the tiny vocabularies are cut from: English, code, Chinese, runs of spaces.
_TINY_TEXT = "the quick brown fox jumps over the lazy dog def main print return value 你好 世界 中文"

TINY_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
        "+ '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
        "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
        "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
}


@dataclass(frozen=True)
class TinyShape:
    """A tiny decoder of one architecture: its GGUF `general.architecture`, shape and what its block needs."""

    arch: str
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 2
    n_kv_heads: int = 1
    head_dim: int = 32
    intermediate: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    sliding_window: int = 0
    vocab: str = "spm"  # spm (SentencePiece pieces with byte fallback) or bpe (byte-level BPE)
    template: str = "chatml"


TINY = {
    "qwen3": TinyShape("qwen3", dim=64, n_heads=4, n_kv_heads=2, head_dim=32, rope_theta=1e6, vocab="bpe"),
    "gemma2": TinyShape("gemma2", n_layers=4, sliding_window=8, template="gemma"),
    "gemma3": TinyShape("gemma3", n_layers=6, sliding_window=8, rope_theta=1e6, template="gemma"),
    "phi3": TinyShape("phi3", n_kv_heads=2, norm_eps=1e-5, template="phi3"),
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes as themselves, the rest shifted past 255.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tiny_vocabulary(kind: str, template: str) -> dict[str, object]:
    """The tokenizer metadata (`tokenizer.ggml.*` values) of a tiny vocabulary: `spm`, SentencePiece pieces (every
    prefix of each word of _TINY_TEXT with its U+2581 space, single characters, runs of spaces, the 256 byte
    pieces) scored best first; or `bpe`, byte-level BPE over the same words (GPT-2's byte alphabet, merges left to
    right). Special tokens as the chat `template` writes them."""
    words = _TINY_TEXT.split()
    if template == "gemma":
        special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    elif template == "phi3":
        special = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]
    else:
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pieces: dict[str, None] = {}
    if kind == "spm":
        byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
        for w in words:
            for piece in (w, "\u2581" + w):
                for end in range(1, len(piece) + 1):
                    pieces[piece[:end]] = None
                pieces.update(dict.fromkeys(piece))
        # Gemma's files spell its runs of spaces with spaces; the other SentencePiece files with U+2581.
        spaces = " " if template == "gemma" else "\u2581"
        pieces.update(dict.fromkeys(spaces * n for n in (2, 3, 4, 8)))
        tokens = [*special, *byte_pieces, *pieces]
        types = [3] * len(special) + [6] * 256 + [1] * len(pieces)
        meta: dict[str, object] = {
            "model": "llama",
            "tokens": tokens,
            "scores": [0.0] * (len(special) + 256) + [-float(i) for i in range(len(pieces))],
            "token_type": types,
            "add_space_prefix": template != "gemma",
        }
    else:
        alphabet = _bytes_to_unicode()
        merges: dict[str, None] = {}
        for w in words:
            spelled = "".join(alphabet[b] for b in (" " + w).encode())
            for end in range(2, len(spelled) + 1):
                merges[f"{spelled[: end - 1]} {spelled[end - 1]}"] = None
                pieces[spelled[:end]] = None
        tokens = [*alphabet.values(), *pieces, *special]
        types = [1] * (256 + len(pieces)) + [3] * len(special)
        meta = {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "token_type": types, "merges": list(merges)}
    ids = {t: i for i, t in enumerate(tokens)}
    bos = {"gemma": "<bos>", "phi3": "<s>"}.get(template)
    eos = {"gemma": "<eos>", "phi3": "<|endoftext|>"}.get(template, "<|im_end|>")
    meta["bos_token_id"] = ids[bos] if bos else None
    meta["eos_token_id"] = ids[eos]
    meta["unknown_token_id"] = ids.get("<unk>")
    meta["padding_token_id"] = ids.get("<pad>", ids.get("<|endoftext|>"))
    meta["add_bos_token"] = bos is not None
    meta["chat_template"] = TINY_TEMPLATES[template]
    return meta


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 ones (round to nearest even), still float32."""
    import numpy as np

    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, sigma: float = 0.25, chat_template: bool = True) -> Path:
    """A random-weight float32 GGUF of `TINY[arch]`'s shape at `path` (weights of spread `sigma`, norms around 1),
    as llama.cpp lays out that architecture: Gemma's norms stored as 1 + w, Phi-3's q/k/v and gate/up fused;
    without `chat_template`, a base model's file (none, as Gemma 3 270M's). Returns `path`."""
    import gguf
    import numpy as np

    shape = TINY[arch]
    rng = np.random.default_rng(seed)
    vocab = tiny_vocabulary(shape.vocab, shape.template)
    n_vocab = len(vocab["tokens"])  # type: ignore[arg-type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}, random weights (specserve synthetic)")
    _add_shape(writer, shape, 256)
    if arch != "phi3":
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if arch == "gemma2":  # the values transformers assumes for a GGUF (it reads neither)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    writer.add_tokenizer_model(str(vocab["model"]))
    if "pre" in vocab:
        writer.add_tokenizer_pre(str(vocab["pre"]))
    writer.add_token_list(vocab["tokens"])  # type: ignore[arg-type]
    writer.add_token_types(vocab["token_type"])  # type: ignore[arg-type]
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])  # type: ignore[arg-type]
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])  # type: ignore[arg-type]
    if vocab["bos_token_id"] is not None:
        writer.add_bos_token_id(int(vocab["bos_token_id"]))  # type: ignore[arg-type]
    writer.add_eos_token_id(int(vocab["eos_token_id"]))  # type: ignore[arg-type]
    if vocab["unknown_token_id"] is not None:
        writer.add_unk_token_id(int(vocab["unknown_token_id"]))  # type: ignore[arg-type]
    writer.add_pad_token_id(int(vocab["padding_token_id"]))  # type: ignore[arg-type]
    writer.add_add_bos_token(bool(vocab["add_bos_token"]))
    if "add_space_prefix" in vocab:
        writer.add_add_space_prefix(bool(vocab["add_space_prefix"]))
    if chat_template:
        writer.add_chat_template(str(vocab["chat_template"]))

    def matrix(rows: int, cols: int) -> np.ndarray:
        return _bf16(rng.normal(0.0, sigma, (rows, cols)))

    def norm(n: int) -> np.ndarray:
        return _bf16(rng.uniform(0.6, 1.4, n))

    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    writer.add_tensor("token_embd.weight", _bf16(rng.normal(0.0, 1.0, (n_vocab, shape.dim))))
    writer.add_tensor("output_norm.weight", norm(shape.dim))
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm(shape.dim))
        if arch == "phi3":
            writer.add_tensor(p + "attn_qkv.weight", matrix(q + 2 * kv, shape.dim))
        else:
            writer.add_tensor(p + "attn_q.weight", matrix(q, shape.dim))
            writer.add_tensor(p + "attn_k.weight", matrix(kv, shape.dim))
            writer.add_tensor(p + "attn_v.weight", matrix(kv, shape.dim))
        if arch in ("qwen3", "gemma3"):
            writer.add_tensor(p + "attn_q_norm.weight", norm(shape.head_dim))
            writer.add_tensor(p + "attn_k_norm.weight", norm(shape.head_dim))
        writer.add_tensor(p + "attn_output.weight", matrix(shape.dim, q))
        writer.add_tensor(p + "ffn_norm.weight", norm(shape.dim))
        if arch.startswith("gemma"):
            writer.add_tensor(p + "post_attention_norm.weight", norm(shape.dim))
            writer.add_tensor(p + "post_ffw_norm.weight", norm(shape.dim))
        if arch == "phi3":
            writer.add_tensor(p + "ffn_up.weight", matrix(2 * shape.intermediate, shape.dim))
        else:
            writer.add_tensor(p + "ffn_gate.weight", matrix(shape.intermediate, shape.dim))
            writer.add_tensor(p + "ffn_up.weight", matrix(shape.intermediate, shape.dim))
        writer.add_tensor(p + "ffn_down.weight", matrix(shape.dim, shape.intermediate))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
