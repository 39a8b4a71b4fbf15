"""Self-distillation data: the target answers seed instructions, in batches, and its hidden states are kept.

A feature-conditioned draft learns to predict the target's next final hidden state (and through the
target's own output layer, its next-token distribution) from the current one and the next token, so
each generated sequence is stored with the target's final-normed hidden state at every position.
Storing the states instead of logits keeps the corpus small: the teacher distribution over any set of
tokens is the target's output layer applied to the stored state, computed while training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from app.engine.model.loading import LoadedModel


@dataclass
class Sample:
    """One sequence: prompt and answer tokens [L], and the target's final hidden state at each [L, dim]."""

    tokens: Tensor
    features: Tensor
    prompt_len: int


def _batch_mask(pad: Tensor, t: int, start: int) -> Tensor:
    """Bool [B, t, start+t]: causal, and no real position may attend to left padding. A padding position
    attends to itself alone, so no softmax row is empty (an empty row gives NaN values in the cache)."""
    b = pad.shape[0]
    span = start + t
    keys = torch.arange(span)
    queries = start + torch.arange(t)
    causal = keys[None, :] <= queries[:, None]  # [t, span]
    key_is_pad = keys[None, :] < pad[:, None]  # [B, span]
    allowed = causal[None] & ~key_is_pad[:, None, :]
    self_pos = keys[None, :] == queries[:, None]
    return allowed | (self_pos[None] & (queries[None, :, None] < pad[:, None, None])).expand(b, t, span)


@torch.inference_mode()
def generate_batch(
    loaded: LoadedModel,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> list[Sample]:
    """Answer `prompts` (token ids) together, left-padded, until each has ended (EOS) or has
    `max_new_tokens` tokens; greedy when temperature is 0. Padding shifts positions, which RoPE's
    relative form makes harmless."""
    model = loaded.model
    dev = model.device  # the model's (a GPU's); what is kept (tokens, states) comes back to the CPU
    eos = torch.tensor(sorted(loaded.tokenizer.eos_token_ids) or [-1])
    b = len(prompts)
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts])
    ids = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
    cache = model.new_cache(width + max_new_tokens, batch=b)
    feats = [model.hidden(ids.to(dev), 0, cache, _batch_mask(pad, width, 0).to(dev))]
    new: list[Tensor] = []
    done = torch.zeros(b, dtype=torch.bool)
    ended_at = torch.full((b,), max_new_tokens)
    pos = width
    for step in range(max_new_tokens):
        logits = model.logits(feats[-1][:, -1]).float()
        if temperature > 0:
            # Drawn on the CPU from the CPU generator: the same corpus for a seed on any device's logits.
            probs = torch.softmax(logits / temperature, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1).cpu()
        new.append(nxt)
        hit = torch.isin(nxt, eos) & ~done
        ended_at[hit] = step + 1
        done |= hit
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        feats.append(model.hidden(nxt[:, None].to(dev), pos, cache, _batch_mask(pad, 1, pos).to(dev)))
        pos += 1
    hidden = torch.cat(feats, dim=1).cpu()  # [B, width + fed, dim]: a state for every token fed
    gen = torch.stack(new, dim=1)
    out = []
    for i in range(b):
        n_new = int(ended_at[i])
        tokens = torch.cat([ids[i, int(pad[i]) :], gen[i, :n_new]])
        # The last token was never fed, so it has no state: the sequence keeps it only as a label.
        state = hidden[i, int(pad[i]) : width + n_new - 1]
        out.append(Sample(tokens.to(torch.int32), state.to(torch.bfloat16).clone(), len(prompts[i])))
    return out


def save_shard(samples: list[Sample], path: Path) -> None:
    """One file of samples: concatenated tokens and states, with offsets."""
    torch.save(
        {
            "tokens": torch.cat([s.tokens for s in samples]),
            "features": torch.cat([s.features for s in samples]),
            "lengths": torch.tensor([len(s.tokens) for s in samples]),
            "prompt_lens": torch.tensor([s.prompt_len for s in samples]),
        },
        path,
    )


def load_shards(paths: Sequence[Path]) -> list[Sample]:
    """Every sample in the shard files at `paths`."""
    out: list[Sample] = []
    for path in paths:
        d = torch.load(path, weights_only=True)
        t_off = f_off = 0
        for n, p in zip(d["lengths"].tolist(), d["prompt_lens"].tolist(), strict=True):
            out.append(Sample(d["tokens"][t_off : t_off + n], d["features"][f_off : f_off + n - 1], p))
            t_off += n
            f_off += n - 1
    return out


def build_corpus(
    loaded: LoadedModel,
    instructions: Sequence[str],
    out_dir: Path,
    batch_size: int,
    max_new_tokens: int,
    temperatures: Sequence[float],
    seed: int,
    progress: Callable[[int, int], None] | None = None,
    prefix: str = "shard",
) -> list[Path]:
    """Answer every instruction (chat template, no system prompt beyond the template's own) and write shards
    of `batch_size` samples into `out_dir`; shards already there are kept, so an interrupted run resumes.
    Batch i samples at temperatures[i % len(temperatures)] (0: greedy). Returns the shard paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = loaded.tokenizer
    encoded = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])) for text in instructions]
    # Similar lengths batch together, so little compute goes into padding.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    paths = []
    tokens_done = 0
    for n, batch in enumerate(batches):
        path = out_dir / f"{prefix}-{n:05d}.pt"
        paths.append(path)
        if path.exists():
            continue
        gen = torch.Generator().manual_seed(seed * 100_003 + n)
        samples = generate_batch(
            loaded, [encoded[i] for i in batch], max_new_tokens, temperatures[n % len(temperatures)], gen
        )
        tmp = path.with_suffix(".tmp")
        save_shard(samples, tmp)
        tmp.rename(path)
        tokens_done += sum(len(s.tokens) - s.prompt_len for s in samples)
        if progress is not None:
            progress(len(batch), tokens_done)
    return paths


def answers(samples: Sequence[Sample], loaded: LoadedModel) -> list[str]:
    """The decoded answers of `samples` (what the second round's text tasks work on)."""
    return [loaded.tokenizer.decode(s.tokens[s.prompt_len :].tolist()) for s in samples]
