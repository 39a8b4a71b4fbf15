"""The architectures the decoder runs, one module each (its config fields, its GGUF and HF tensor names, what its
block does beyond Llama's), and one registry line each below. To add one: write its module on `base`'s helpers,
set the `ModelConfig` fields its block needs (adding a step to `transformer.DecoderBlock` only for something no
field covers yet), and add it to `REGISTRY`."""

from __future__ import annotations

from app.engine.model.architectures import gemma, llama, phi3, qwen2, qwen3
from app.engine.model.architectures.base import Architecture, WeightsError

REGISTRY: dict[str, Architecture] = {
    a.name: a
    for a in (
        llama.LLAMA,
        llama.MISTRAL,
        llama.SMOLLM,
        qwen2.QWEN2,
        qwen3.QWEN3,
        gemma.GEMMA2,
        gemma.GEMMA3,
        phi3.PHI3,
    )
}

# Architectures this decoder does not implement, with the reason, so that the refusal says what is missing rather
# than just "not supported" (the same name in GGUF `general.architecture` and HF `model_type`).
UNIMPLEMENTED = {
    "smollm3": "its NoPE layers (every 4th layer without RoPE) are not implemented, so every logit would be wrong",
}


def gguf(name: str | None, source: str) -> Architecture:
    """The entry for GGUF `general.architecture` `name`; a WeightsError naming the supported ones otherwise."""
    if name in UNIMPLEMENTED:
        raise WeightsError(f"{source}: architecture {name!r} is not supported: {UNIMPLEMENTED[name]}")
    if name not in REGISTRY:
        raise WeightsError(f"{source}: architecture {name!r} is not supported (supported: {sorted(REGISTRY)})")
    return REGISTRY[name]


def hf(model_type: str | None, source: str) -> Architecture:
    """The entry for HF `model_type`; a WeightsError naming the supported ones otherwise."""
    if model_type in UNIMPLEMENTED:
        raise WeightsError(f"{source}: model_type {model_type!r} is not supported: {UNIMPLEMENTED[model_type]}")
    for a in REGISTRY.values():
        if model_type in a.hf_model_types:
            return a
    raise WeightsError(f"{source}: model_type {model_type!r} is not supported (supported: {hf_model_types()})")


def hf_model_types() -> list[str]:
    return sorted(t for a in REGISTRY.values() for t in a.hf_model_types)


__all__ = ["REGISTRY", "UNIMPLEMENTED", "Architecture", "WeightsError", "gguf", "hf", "hf_model_types"]
