"""llama.cpp as a baseline for `specserve bench`: what a CPU user would run instead, on the same GGUF.

llama.cpp runs through its Python binding (`pip install llama-cpp-python`, which builds llama.cpp from
source for this CPU); it is not a dependency of specserve. Besides the catalog GGUF's own weights (Q4_1 for
the default target) it runs F32 and BF16 copies of them, written here by `convert_gguf`: the weights our
engine dequantizes at load, so llama.cpp computes with the same numbers we do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

# GGUF `general.file_type` values (llama.cpp's llama_ftype) of the copies this module writes.
_FILE_TYPES = {"f32": 0, "bf16": 32}


def convert_gguf(src: Path, dst: Path, kind: str) -> Path:
    """Write `src`'s tensors dequantized to `kind` (`f32` or `bf16`) into `dst`, every metadata field copied.

    Vectors (norm weights) stay float32, as llama.cpp expects them. Returns `dst`; an existing `dst` is
    kept (the conversion depends on nothing but `src`)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from app.engine.model.gguf_file import GGUFFile

    if kind not in _FILE_TYPES:
        raise ValueError(f"unknown GGUF type {kind!r}; choose {', '.join(_FILE_TYPES)}")
    if dst.exists():
        return dst
    reader = GGUFFile(src)
    arch = str(reader.fields["general.architecture"])
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, value in reader.fields.items():
        if name in ("general.architecture", "general.file_type"):
            continue  # the writer's own, and the type written below
        vtype, sub = reader.types[name]
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.add_key_value("general.file_type", _FILE_TYPES[kind], gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        if kind == "bf16" and data.ndim > 1:
            bf16 = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(t.name, quantize(data, bf16), raw_dtype=bf16)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


class LlamaCppRunner:
    """Greedy decoding by llama.cpp (2 threads by default, like torch here) on one GGUF file.

    `lookup` > 0: the binding's prompt-lookup decoding (`LlamaPromptLookupDecoding`, drafting up to `lookup`
    tokens from an earlier occurrence of the last one or two tokens), its llama.cpp anchor beside our lookups.
    `reuse_prefix`: keep the KV cache between calls, so that a prompt extending the previous call's prompt
    prefills only what is new (as llama-cpp-python does for a conversation); otherwise every call prefills its
    whole prompt."""

    def __init__(
        self, path: Path, threads: int, context: int = 4096, lookup: int = 0, reuse_prefix: bool = False
    ) -> None:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise RuntimeError(
                "llama.cpp baselines need its Python binding: pip install llama-cpp-python (builds llama.cpp)"
            ) from exc
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup > 0 else None
        self.model = Llama(
            str(path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context,
            draft_model=draft,
            # A draft needs every position's logits; the binding sizes its buffer for them only when asked (left
            # False with a draft, prompts past n_batch tokens overflow it).
            logits_all=draft is not None,
            verbose=False,
        )
        self.eos = self.model.token_eos()
        self.reuse_prefix = reuse_prefix

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Generated token ids and the seconds they took (prefill included), greedy, stopping at EOS."""
        out: list[int] = []
        if not self.reuse_prefix:
            self.model.reset()
        t0 = time.perf_counter()
        for tok in self.model.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if tok == self.eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0


# `lookup` runs the catalog GGUF with the binding's prompt lookup drafting this many tokens (its own default).
LOOKUP_TOKENS = 10


def runners(source: Path, kinds: list[str], cache: Path, threads: int, reuse_prefix: bool = False) -> dict[str, Any]:
    """`llama.cpp/KIND` runners for `source`: KIND `gguf` is the file itself, `f32`/`bf16` converted copies,
    `lookup` the file with prompt-lookup decoding (which brings `gguf` along first, the target-only output its
    greedy output must equal). `reuse_prefix`: as `LlamaCppRunner`'s."""
    if "lookup" in kinds and "gguf" not in kinds:
        kinds = ["gguf", *kinds]
    out: dict[str, Any] = {}
    for kind in kinds:
        if kind == "lookup":
            out["llama.cpp/lookup"] = LlamaCppRunner(source, threads, lookup=LOOKUP_TOKENS, reuse_prefix=reuse_prefix)
            continue
        path = source if kind == "gguf" else convert_gguf(source, cache / f"{source.stem}.{kind}.gguf", kind)
        out[f"llama.cpp/{kind}"] = LlamaCppRunner(path, threads, reuse_prefix=reuse_prefix)
    return out
