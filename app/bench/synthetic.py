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


def write_gguf(path: Path, shape: Shape, fmt: str, tokenizer_from: Path, seed: int = 0, progress: bool = False) -> Path:
    """Write a `fmt` GGUF of `shape` with random weights at `path`, tensor by tensor (through `path`.partial,
    renamed at the end: an interrupted write leaves no file). The tokenizer metadata comes from the GGUF
    `tokenizer_from` (its vocabulary must be `shape.vocab` tokens). Returns `path`."""
    import gguf
    import numpy as np

    plan = tensor_plan(shape, fmt)
    source = gguf.GGUFReader(str(tokenizer_from))
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != shape.vocab:
        raise ValueError(f"{tokenizer_from} holds no tokenizer of {shape.vocab} tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"{shape.label} shape, random weights ({fmt}, specserve synthetic)")
    writer.add_file_type(FORMATS[fmt][0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.dim)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    for name, f in source.fields.items():
        if name.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
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
