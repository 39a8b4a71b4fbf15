"""A tenant's learned change to a feature draft: a low-rank update of its fusion layer and a bias over its vocabulary.

The shipped draft stays as it was (quantized, in one C call for its decoder layer); a tenant's adapter adds to what
the draft computes where that is cheap to do beside it: the fusion layer's output (`x = fc(u) + up(down(u))`,
u = [embedding, state], rank r) and the draft-vocabulary logits (`+ bias`). Zero `up` and `bias` give the shipped
draft exactly, so training starts from it. A rank-8 adapter of the default 576-wide draft is about 90 KB, which is
what a tenant costs (app.distill.online trains them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

DEFAULT_RANK = 8


@dataclass
class Adapter:
    """down [rank, 2*dim], up [dim, rank], bias [draft vocab], float32; `draft`: the fingerprint of the draft it
    was trained on (`draft_fingerprint`): an adapter is only ever applied to that draft."""

    down: Tensor
    up: Tensor
    bias: Tensor
    draft: str

    @classmethod
    def zeros(cls, dim: int, vocab: int, draft: str, rank: int = DEFAULT_RANK, seed: int = 0) -> Adapter:
        """An adapter that changes nothing yet: `down` small and random (so that `up` gets a gradient), `up` and
        `bias` zero."""
        gen = torch.Generator().manual_seed(seed)
        down = torch.randn(rank, 2 * dim, generator=gen) / (2 * dim) ** 0.5
        return cls(down, torch.zeros(dim, rank), torch.zeros(vocab), draft)

    def fusion(self, inputs: Tensor) -> Tensor:
        """What the adapter adds to the fusion layer's output [..., dim] for its inputs [..., 2*dim]."""
        return (inputs.to(self.down.dtype) @ self.down.T) @ self.up.T

    def logits(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits [..., vocab] with the adapter's bias added."""
        return logits + self.bias.to(logits.dtype)

    def clone(self) -> Adapter:
        return Adapter(self.down.detach().clone(), self.up.detach().clone(), self.bias.detach().clone(), self.draft)

    def parameters(self) -> list[Tensor]:
        return [self.down, self.up, self.bias]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def save(self, path: Path) -> None:
        """Write to `path` (atomically: a reader sees the old file or the new one)."""
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"down": self.down.contiguous(), "up": self.up.contiguous(), "bias": self.bias.contiguous()}
        save_file(tensors, str(tmp), metadata={"draft": self.draft})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Adapter:
        """Read an adapter `save` wrote; ValueError when the file is not one."""
        try:
            tensors = load_file(str(path))
            with path.open("rb") as f:  # safetensors' header: 8 bytes of length, then JSON with the metadata
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            draft = header["__metadata__"]["draft"]
            down, up, bias = (tensors[name].float() for name in ("down", "up", "bias"))
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            raise ValueError(f"{path} is not a draft adapter: {exc}") from exc
        if down.ndim != 2 or up.shape != (down.shape[1] // 2, down.shape[0]) or bias.ndim != 1:
            raise ValueError(f"{path}: shapes {tuple(down.shape)}, {tuple(up.shape)}, {tuple(bias.shape)} do not fit")
        return cls(down, up, bias, draft)


def draft_fingerprint(weights_file: Path) -> str:
    """A short digest of a draft's weights file: which draft an adapter belongs to."""
    digest = hashlib.sha256()
    with weights_file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]
