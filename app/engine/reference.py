"""The reference contract of one speculative step, written for clarity, not speed.

No KV cache: every call runs whole sequences. The production loop (`generation.py`) must agree with it;
the tests hold both to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from app.engine.model.transformer import Transformer


def build_causal_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool [seq_len, seq_len]: position i may attend to position j exactly when j <= i."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


@torch.inference_mode()
def full_lm_forward(model: Transformer, token_ids: Sequence[int] | Tensor, mask: Tensor) -> Tensor:
    """Logits [T, vocab] of `model` over the whole sequence `token_ids` (T ids), under `mask` [T, T]."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    return model(ids, mask=mask)[0]


def greedy_decode(model: Transformer, token_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The `num_tokens` ids that greedy decoding appends to `token_ids`, one full forward per token."""
    seq = list(token_ids)
    out: list[int] = []
    for _ in range(num_tokens):
        logits = full_lm_forward(model, seq, build_causal_mask(len(seq), model.device))
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


def speculative_decode_step(
    token_ids: Sequence[int], draft: Transformer, target: Transformer, num_draft_tokens: int
) -> list[int]:
    """One greedy draft-and-verify step; returns the tokens it adds after `token_ids`.

    The draft proposes `num_draft_tokens` tokens greedily; the target runs once over the whole drafted
    sequence; drafted tokens are accepted in order while they equal the target's argmax, and the first
    one that does not is replaced by the target's argmax, with nothing after it.
    """
    if num_draft_tokens < 1:
        raise ValueError("num_draft_tokens must be at least 1")
    prompt = list(token_ids)
    drafted = greedy_decode(draft, prompt, num_draft_tokens)
    seq = prompt + drafted
    logits = full_lm_forward(target, seq, build_causal_mask(len(seq), target.device))
    # The target's choice for drafted position i is read at the position just before it.
    choices = logits[len(prompt) - 1 : len(seq) - 1].argmax(-1).tolist()
    out: list[int] = []
    for proposed, chosen in zip(drafted, choices, strict=True):
        if proposed != chosen:
            out.append(chosen)
            break
        out.append(proposed)
    return out
