"""Self-distillation data: the target answers seed instructions, in batches, and its hidden states are kept.

A feature-conditioned draft learns to predict the target's next final hidden state (and through the
target's own output layer, its next-token distribution) from the current one and the next token, so
each generated sequence is stored with the target's final-normed hidden state at every position.
Storing the states instead of logits keeps the corpus small: the teacher distribution over any set of
tokens is the target's output layer applied to the stored state, computed while training.
"""

from __future__ import annotations

import hashlib
import json
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


Prompt = str | list[dict[str, str]]  # an instruction, or a whole conversation ending with a user turn


def prompt_key(prompt: Prompt) -> str:
    """A stable name for `prompt`: what a shard records, so that a later run answers only what is new."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def _features_path(path: Path) -> Path:
    return path.with_suffix(".features.pt")


def save_shard(samples: list[Sample], path: Path, keys: Sequence[str] = ()) -> None:
    """One shard of samples: the token ids (concatenated, with lengths, prompt lengths and each prompt's key) in
    `path`, and the target's states beside it (`NAME.features.pt`), which `compute_features` can make again from
    the ids alone (for a target in another precision, or a corpus copied without them)."""
    torch.save(
        {
            "tokens": torch.cat([s.tokens for s in samples]),
            "lengths": torch.tensor([len(s.tokens) for s in samples]),
            "prompt_lens": torch.tensor([s.prompt_len for s in samples]),
            "keys": list(keys),
        },
        path,
    )
    torch.save({"features": torch.cat([s.features for s in samples])}, _features_path(path))


def _read_ids(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def load_shards(paths: Sequence[Path]) -> list[Sample]:
    """Every sample in the shard files at `paths`, with its states (`compute_features` first where a shard has
    none)."""
    out: list[Sample] = []
    for path in paths:
        d = _read_ids(path)
        features = torch.load(_features_path(path), weights_only=True)["features"]
        t_off = f_off = 0
        for n, p in zip(d["lengths"].tolist(), d["prompt_lens"].tolist(), strict=True):
            out.append(Sample(d["tokens"][t_off : t_off + n], features[f_off : f_off + n - 1], p))
            t_off += n
            f_off += n - 1
    return out


@torch.inference_mode()
def compute_features(loaded: LoadedModel, paths: Sequence[Path], batch_tokens: int = 8192) -> int:
    """Write the states of every shard at `paths` that has none: the target's final hidden states over each
    stored sequence, teacher-forced (one forward per batch of similar lengths, right-padded, which causal
    attention makes harmless). Returns the positions computed."""
    model, dev = loaded.model, loaded.model.device
    done = 0
    for path in paths:
        if _features_path(path).exists():
            continue
        d = _read_ids(path)
        seqs = list(torch.split(d["tokens"], d["lengths"].tolist()))
        feats: list[Tensor | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        i = 0
        while i < len(order):
            width = len(seqs[order[i]]) - 1
            rows = max(1, batch_tokens // max(width, 1))
            group = order[i : i + rows]
            width = max(len(seqs[j]) - 1 for j in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            for r, j in enumerate(group):
                ids[r, : len(seqs[j]) - 1] = seqs[j][:-1].long()
            hidden = model.hidden(ids.to(dev)).cpu()
            for r, j in enumerate(group):
                feats[j] = hidden[r, : len(seqs[j]) - 1].to(torch.bfloat16)
                done += len(seqs[j]) - 1
            i += rows
        tmp = _features_path(path).with_suffix(".tmp")
        torch.save({"features": torch.cat([f for f in feats if f is not None])}, tmp)
        tmp.rename(_features_path(path))
    return done


def encode_prompt(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    """The chat-templated token ids of an instruction or conversation."""
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tok.encode(tok.apply_chat_template(messages))


def build_corpus(
    loaded: LoadedModel,
    prompts: Sequence[Prompt],
    out_dir: Path,
    batch_size: int,
    max_new_tokens: int,
    temperatures: Sequence[float],
    seed: int,
    progress: Callable[[int, int], None] | None = None,
    prefix: str = "shard",
) -> list[Path]:
    """Answer every prompt (an instruction, or a conversation ending with a user turn; chat template) and write
    shards of `batch_size` samples into `out_dir`. Prompts some shard of `prefix` already answered are skipped,
    so an interrupted run resumes and a run with more prompts extends the corpus; every shard of `prefix` in
    `out_dir` belongs to the corpus. The i-th new shard samples at temperatures[i % len(temperatures)] (0:
    greedy). Returns the paths of every shard of `prefix`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(out_dir.glob(f"{prefix}-[0-9]*[0-9].pt"))
    done = {key for path in existing for key in _read_ids(path).get("keys", [])}
    todo = [(key, p) for key, p in ((prompt_key(p), p) for p in prompts) if key not in done]
    todo = list({key: p for key, p in todo}.items())  # a prompt listed twice is answered once
    encoded = [encode_prompt(loaded, p) for _, p in todo]
    # Similar lengths batch together, so little compute goes into padding.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    first = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in existing), default=-1)
    paths = list(existing)
    tokens_done = 0
    for n, batch in enumerate(batches, start=first):
        path = out_dir / f"{prefix}-{n:05d}.pt"
        gen = torch.Generator().manual_seed(seed * 100_003 + n)
        samples = generate_batch(
            loaded, [encoded[i] for i in batch], max_new_tokens, temperatures[n % len(temperatures)], gen
        )
        tmp = path.with_suffix(".tmp")
        # The states go straight to their name; the ids appear last, so a shard whose ids exist is whole.
        save_shard(samples, tmp, [todo[i][0] for i in batch])
        tmp.rename(path)
        paths.append(path)
        tokens_done += sum(len(s.tokens) - s.prompt_len for s in samples)
        if progress is not None:
            progress(len(batch), tokens_done)
    return paths


def answers(paths: Sequence[Path], loaded: LoadedModel) -> dict[str, str]:
    """The decoded answer of every sample in the shards at `paths`, by its prompt's key (`prompt_key`)."""
    out: dict[str, str] = {}
    for path in paths:
        d = _read_ids(path)
        seqs = torch.split(d["tokens"], d["lengths"].tolist())
        for key, seq, p in zip(d["keys"], seqs, d["prompt_lens"].tolist(), strict=True):
            out[key] = loaded.tokenizer.decode(seq[p:].tolist(), skip_special_tokens=True)
    return out
