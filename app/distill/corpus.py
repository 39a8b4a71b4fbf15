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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from app.engine.model.cache import KVCache
from app.engine.model.loading import LoadedModel


@dataclass
class Sample:
    """One sequence: prompt and answer tokens [L], and the target's final hidden state at each [L, dim]."""

    tokens: Tensor
    features: Tensor
    prompt_len: int


def _draw(logits: Tensor, temperature: float, generator: torch.Generator) -> int:
    """The next token from one row's logits [vocab] (on the CPU): argmax at temperature 0, else a draw from the
    prompt's own generator (the same corpus for a seed on any device, whatever else ran beside it)."""
    if temperature > 0:
        # By the inverse of the cumulative distribution, from one uniform number: torch.multinomial took 6 ms a row
        # over Gemma 3's 262,144 tokens (half of a 48-row corpus step), this half a millisecond. In float64, so
        # that the last cumulative sums still step by the smallest probabilities; `right`: the first sum above the
        # draw, which a token of probability 0 (an unchanged sum) never is.
        cumulative = torch.softmax(logits.double() / temperature, -1).cumsum(0)
        u = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative[-1]
        return min(int(torch.searchsorted(cumulative, u, right=True)), cumulative.shape[0] - 1)
    return int(logits.argmax())


@dataclass
class _Answering:
    """A prompt in flight: its ids (prompt, then what it sampled), its states so far and its own generator."""

    index: int
    ids: list[int]
    temperature: float
    generator: torch.Generator
    prompt_len: int = field(init=False)
    states: list[Tensor] = field(default_factory=list)
    fed: int = 0  # tokens whose keys and values its cache holds (continuous batching)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.ids)


@torch.inference_mode()
def generate(
    loaded: LoadedModel,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    temperatures: Sequence[float],
    seeds: Sequence[int],
    rows: int = 48,
    prefill_tokens: int = 4096,
    continuous: bool | None = None,
) -> Iterator[tuple[int, Sample]]:
    """Answer `prompts` (token ids), up to `rows` at a time in one target forward, each until it has ended
    (EOS) or has `max_new_tokens` tokens; prompt i samples at temperatures[i] (0: greedy) from its own generator
    seeded with seeds[i]. Yields (i, sample) as prompts end.

    `continuous` (default: on a CPU): each prompt has its own KV cache and joins the forward when another
    leaves, as the server's batches do, so no row is padding and no ended row is computed again; a step
    prefills new prompts of up to `prefill_tokens` tokens in all (at least one). Where the target's rows do not
    depend on the rows beside them (the CPU kernels), an answer is then the one the prompt gets alone. Otherwise
    (an accelerator, where one attention call per prompt and layer would cost more than padding): prompts of
    similar lengths go together, left-padded in one cache, until all of them have ended."""
    if continuous is None:
        continuous = loaded.model.device.type == "cpu"
    order = list(range(len(prompts)))
    if not continuous:
        order.sort(key=lambda i: len(prompts[i]))  # similar lengths together: little compute on padding
    answering = [_Answering(i, list(prompts[i]), float(temperatures[i]), _generator(seeds[i])) for i in order]
    if continuous:
        yield from _continuous(loaded, answering, max_new_tokens, rows, prefill_tokens)
    else:
        for b in range(0, len(answering), rows):
            yield from _padded(loaded, answering[b : b + rows], max_new_tokens)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _ended(a: _Answering, eos: set[int], max_new_tokens: int) -> bool:
    return a.ids[-1] in eos or len(a.ids) - a.prompt_len == max_new_tokens


def _sample(a: _Answering) -> tuple[int, Sample]:
    # The last token was never fed, so it has no state: the sequence keeps it only as a label.
    state = torch.cat(a.states).to(torch.bfloat16)
    return a.index, Sample(torch.tensor(a.ids, dtype=torch.int32), state, a.prompt_len)


def _continuous(
    loaded: LoadedModel, waiting: list[_Answering], max_new_tokens: int, rows: int, prefill_tokens: int
) -> Iterator[tuple[int, Sample]]:
    model = loaded.model
    eos = set(loaded.tokenizer.eos_token_ids)
    waiting = waiting[::-1]
    active: list[tuple[_Answering, KVCache]] = []  # each prompt with its own cache
    while waiting or active:
        budget = prefill_tokens
        while waiting and len(active) < rows and (budget >= waiting[-1].prompt_len or budget == prefill_tokens):
            a = waiting.pop()
            budget -= a.prompt_len
            active.append((a, model.new_cache(a.prompt_len + max_new_tokens)))
        feeds = [torch.tensor(a.ids[a.fed :], dtype=torch.long, device=model.device) for a, _ in active]
        hidden = model.hidden_batch([(f, a.fed, c) for f, (a, c) in zip(feeds, active, strict=True)])
        logits = model.logits(torch.cat([h[-1:] for h in hidden])).float().cpu()
        still: list[tuple[_Answering, KVCache]] = []
        for (a, cache), h, f, row in zip(active, hidden, feeds, logits, strict=True):
            a.states.append(h.cpu())
            a.fed += f.shape[0]
            a.ids.append(_draw(row, a.temperature, a.generator))
            if _ended(a, eos, max_new_tokens):
                yield _sample(a)
            else:
                still.append((a, cache))
        active = still


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


def _padded(loaded: LoadedModel, batch: list[_Answering], max_new_tokens: int) -> Iterator[tuple[int, Sample]]:
    """`batch` left-padded in one cache, stepped until every prompt has ended; padding shifts positions, which
    RoPE's relative form makes harmless."""
    model = loaded.model
    dev = model.device
    eos = set(loaded.tokenizer.eos_token_ids)
    width = max(a.prompt_len for a in batch)
    pad = torch.tensor([width - a.prompt_len for a in batch])
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for r, a in enumerate(batch):
        ids[r, width - a.prompt_len :] = torch.tensor(a.ids)
    cache = model.new_cache(width + max_new_tokens, batch=len(batch))
    hidden = model.hidden(ids.to(dev), 0, cache, _batch_mask(pad, width, 0).to(dev))
    kept = hidden.cpu()
    for r, a in enumerate(batch):
        a.states.append(kept[r, int(pad[r]) :])
    pos, last, live = width, hidden[:, -1], list(range(len(batch)))
    while True:
        logits = model.logits(last).float().cpu()
        still = []
        for r in live:
            a = batch[r]
            a.ids.append(_draw(logits[r], a.temperature, a.generator))
            if _ended(a, eos, max_new_tokens):
                yield _sample(a)
            else:
                still.append(r)
        live = still
        if not live:
            return
        # Ended rows keep stepping (on their last token) beside the others: a padded batch cannot drop them.
        nxt = torch.tensor([a.ids[-1] for a in batch])[:, None]
        last = model.hidden(nxt.to(dev), pos, cache, _batch_mask(pad, 1, pos).to(dev))[:, -1]
        kept = last.cpu()
        for r in live:
            batch[r].states.append(kept[r : r + 1])
        pos += 1


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
        feats = teacher_forced(seqs, lambda ids: model.hidden(ids.to(dev)).cpu(), batch_tokens)
        done += sum(f.shape[0] for f in feats)
        tmp = _features_path(path).with_suffix(".tmp")
        torch.save({"features": torch.cat(feats)}, tmp)
        tmp.rename(_features_path(path))
    return done


def teacher_forced(seqs: Sequence[Tensor], forward: Callable[[Tensor], Tensor], batch_tokens: int) -> list[Tensor]:
    """Per sequence [L] its states [L - 1, D] (bf16) over every token but the last: `forward` (long ids [B, T] ->
    [B, T, D]) once per batch of similar lengths, about `batch_tokens` positions each, right-padded (harmless under
    causal attention)."""
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
        hidden = forward(ids)
        for r, j in enumerate(group):
            feats[j] = hidden[r, : len(seqs[j]) - 1].to(torch.bfloat16)
        i += rows
    return [f for f in feats if f is not None]


def encode_prompt(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    """The chat-templated token ids of an instruction or conversation; for a target without a chat template (a base
    model, as Gemma 3 270M's GGUF) the text as it is (a conversation's turns one after another, a blank line
    between), as its completions route and the bench send it."""
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if tok.chat_template is None:
        return tok.encode("\n\n".join(str(m["content"]) for m in messages))
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
    rows: int = 48,
) -> list[Path]:
    """Answer every prompt (an instruction, or a conversation ending with a user turn; chat template), `rows` at
    a time (`generate`), and write the answers into `out_dir` in shards of `batch_size`, in the order they end.
    Prompts some shard of `prefix` already answered are skipped, so an interrupted run resumes and a run with
    more prompts extends the corpus; every shard of `prefix` in `out_dir` belongs to the corpus. A prompt
    samples at one of `temperatures` (0: greedy) and from a generator seeded by `seed` and the prompt itself,
    both chosen by its key: its answer does not depend on the other prompts of a run. `progress(answers,
    answer tokens so far)` after each shard. Returns the paths of every shard of `prefix`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(out_dir.glob(f"{prefix}-[0-9]*[0-9].pt"))
    done = {key for path in existing for key in _read_ids(path).get("keys", [])}
    todo = [(key, p) for key, p in ((prompt_key(p), p) for p in prompts) if key not in done]
    todo = list({key: p for key, p in todo}.items())  # a prompt listed twice is answered once
    encoded = [encode_prompt(loaded, p) for _, p in todo]
    numbers = [int(key, 16) for key, _ in todo]
    temps = [temperatures[n % len(temperatures)] for n in numbers]
    seeds = [(seed * 100_003 + n) % 2**63 for n in numbers]
    paths = list(existing)
    shard = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in existing), default=-1)
    tokens_done = 0
    finished: list[tuple[int, Sample]] = []

    def write() -> None:
        nonlocal shard, tokens_done
        path = out_dir / f"{prefix}-{shard:05d}.pt"
        tmp = path.with_suffix(".tmp")
        # The states go straight to their name; the ids appear last, so a shard whose ids exist is whole.
        save_shard([s for _, s in finished], tmp, [todo[i][0] for i, _ in finished])
        tmp.rename(path)
        paths.append(path)
        shard += 1
        tokens_done += sum(len(s.tokens) - s.prompt_len for _, s in finished)
        if progress is not None:
            progress(len(finished), tokens_done)
        finished.clear()

    for answer in generate(loaded, encoded, max_new_tokens, temps, seeds, rows):
        finished.append(answer)
        if len(finished) == batch_size:
            write()
    if finished:
        write()
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
