"""Training a feature draft on the self-distillation corpus.

Loss, per answer position p: the cross-entropy of the draft's distribution over its vocabulary against
the target's own distribution there (soft labels: the target's output layer applied to the stored state
h_(p+1)), plus a small regression of the predicted state onto h_(p+1). Every batch is unrolled `unroll`
times (EAGLE-3's training-time test): the first pass reads the target's true states, and pass j reads, at
each position, the state pass j-1 predicted for it, as the draft reads its own guesses from its second
drafted token on; pass j is what its j-th drafted token sees. Without the later passes the draft learns to
continue true states only and its second and later guesses fall apart.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from app.distill.corpus import Sample
from app.engine import kernels
from app.engine.drafting.adapter import Adapter
from app.engine.drafting.eagle import EagleDraft
from app.engine.model.transformer import Transformer


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    seq_len: int
    tokens_per_batch: int
    seed: int
    regression_weight: float = 0.2
    warmup: int = 50
    checkpoint_every: int = 200
    # `bfloat16`: autocast; `float32`: no autocast, the corpus states and the borrowed output rows in float32
    # too; `auto`: bfloat16 on a GPU that has it and a CPU that multiplies it in hardware, else float32 (an
    # AVX2 CPU's emulated bf16 products are several times slower than its float32 ones).
    precision: str = "auto"
    unroll: int = 3


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype training computes in for `precision` (TrainConfig's) on `device`."""
    if precision not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"precision {precision!r}: choose auto, bfloat16 or float32")
    if precision != "auto":
        return torch.bfloat16 if precision == "bfloat16" else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if kernels.bf16_arithmetic() else torch.float32


@dataclass
class Batch:
    states: Tensor  # [B, T, dim] target states h_p, bf16
    next_tokens: Tensor  # long [B, T]: token p+1
    goal: Tensor  # [B, T, dim]: h_(p+1)
    weight: Tensor  # [B, T]: 1 where the loss counts (answer positions), 0 on prompt and padding

    def to(self, device: torch.device, states_dtype: torch.dtype | None = None) -> Batch:
        """The batch on `device` (batches are made on the CPU, where the corpus is), its states and goals in
        `states_dtype` (None: as stored, bf16)."""
        states, goal = (t.to(device, states_dtype) for t in (self.states, self.goal))
        return Batch(states, self.next_tokens.to(device), goal, self.weight.to(device))


def batch_of(pieces: Sequence[tuple[Sample, int, int]], width: int) -> Batch:
    """One row per (sample, a, b): positions a..b-1 of it (states, the next tokens, the next states as goals),
    padded to `width`; position p counts where token p+2 belongs to the answer."""
    dim = pieces[0][0].features.shape[1]
    states = torch.zeros(len(pieces), width, dim, dtype=torch.bfloat16)
    goal = torch.zeros(len(pieces), width, dim, dtype=torch.bfloat16)
    nxt = torch.zeros(len(pieces), width, dtype=torch.long)
    weight = torch.zeros(len(pieces), width)
    for r, (s, a, b) in enumerate(pieces):
        n = b - a
        states[r, :n] = s.features[a:b]
        goal[r, :n] = s.features[a + 1 : b + 1]
        nxt[r, :n] = s.tokens[a + 1 : b + 1].long()
        weight[r, :n] = (torch.arange(a, b) + 2 >= s.prompt_len).float()
    return Batch(states, nxt, goal, weight)


def make_batches(samples: Sequence[Sample], cfg: TrainConfig, rng: random.Random) -> list[Batch]:
    """One epoch of batches: sequences cut to seq_len, grouped by length, `tokens_per_batch` positions each."""
    pieces = []
    for s in samples:
        n = s.features.shape[0]  # states for positions 0..n-1; tokens 0..n
        if n < 3:
            continue
        # A long sequence keeps its end: the answer follows the prompt, and only answer positions count.
        start = max(0, n - 1 - cfg.seq_len)
        pieces.append((s, start, min(n - 1, start + cfg.seq_len)))
    rng.shuffle(pieces)
    pieces.sort(key=lambda p: p[2] - p[1])
    batches: list[Batch] = []
    i = 0
    while i < len(pieces):
        t = pieces[i][2] - pieces[i][1]
        rows = max(1, cfg.tokens_per_batch // max(t, 1))
        group = pieces[i : i + rows]
        t = max(end - start for _, start, end in group)
        batches.append(batch_of(group, t))
        i += rows
    rng.shuffle(batches)
    return batches


def _pass_loss(
    draft: EagleDraft, states: Tensor, batch: Batch, teacher: Tensor, reg_weight: float, adapter: Adapter | None
) -> tuple[Tensor, Tensor, Tensor]:
    guess = draft(states, batch.next_tokens, adapter=adapter)
    logp = F.log_softmax(draft.draft_logits(guess, adapter).float(), -1)
    w = batch.weight
    ce = -(teacher * logp).sum(-1)
    ce = (ce * w).sum() / w.sum().clamp_min(1)
    agree = ((logp.argmax(-1) == teacher.argmax(-1)).float() * w).sum() / w.sum().clamp_min(1)
    if not reg_weight:
        return ce, agree, guess
    reg = F.smooth_l1_loss(guess.float(), batch.goal.float(), reduction="none").mean(-1)
    reg = (reg * w).sum() / w.sum().clamp_min(1)
    return ce + reg_weight * reg, agree, guess


def unrolled_loss(
    draft: EagleDraft, batch: Batch, unroll: int, reg_weight: float, adapter: Adapter | None = None
) -> tuple[Tensor, list[Tensor]]:
    """The loss of one batch (module docstring), summed over `unroll` passes, and each pass's top-1 agreement with
    the target; through `adapter` where given (the server's draft learning, app.distill.online). Call inside the
    caller's autocast."""
    with torch.no_grad():
        teacher = torch.softmax(draft.draft_logits(batch.goal).float(), -1)
    fed, parts, agrees = batch.states, [], []
    for _ in range(max(1, unroll)):
        part, agree, guess = _pass_loss(draft, fed, batch, teacher, reg_weight, adapter)
        parts.append(part)
        agrees.append(agree)
        # The next pass: position p reads the state this pass guessed for it (position 0 has none).
        fed = torch.cat([batch.states[:, :1], guess[:, :-1].to(batch.states.dtype)], dim=1)
    return torch.stack(parts).sum(), agrees


def train(
    draft: EagleDraft,
    target: Transformer,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    checkpoint: Path,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train `draft` (float32, attached to `target`) for cfg.steps optimizer steps, resuming from
    `checkpoint` when it exists and writing it every cfg.checkpoint_every steps. Trains on the draft's device
    (the target's: a GPU's when it runs on one), the batches moved there one by one. Returns the final
    running figures (loss, top-1 agreement of each pass: agree1, agree2, ...) and the positions trained on in
    this run, per second."""
    dev = next(draft.parameters()).device
    dtype = compute_dtype(cfg.precision, dev)
    if dtype == torch.float32:
        # The borrowed output rows (the target's, bf16, never trained) in float32 with everything else.
        draft._head_rows = draft._head_rows.float()
    torch.manual_seed(cfg.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=dev, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    rng = random.Random(cfg.seed * 7919 + step)
    running: dict[str, float] = {}
    batches: list[Batch] = []
    t0 = time.perf_counter()
    tokens = 0
    draft.train()
    while step < cfg.steps:
        if not batches:
            batches = make_batches(samples, cfg, rng)
        batch = batches.pop().to(dev, dtype)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, agrees = unrolled_loss(draft, batch, cfg.unroll, cfg.regression_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += int(batch.weight.numel())
        figures = [("loss", loss.item())] + [(f"agree{j + 1}", a.item()) for j, a in enumerate(agrees)]
        for key, val in figures:
            running[key] = val if key not in running else 0.98 * running[key] + 0.02 * val
        running["positions_per_s"] = tokens / (time.perf_counter() - t0)
        running["lr"] = lr
        if progress is not None:
            progress(step, running)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            tmp.rename(checkpoint)
    draft.eval()
    return running


def choose_vocab(samples: Sequence[Sample], size: int, vocab_size: int, always: Sequence[int]) -> Tensor:
    """The `size` most frequent answer tokens of the corpus (plus `always`, e.g. EOS), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.tokens[s.prompt_len :].long(), minlength=vocab_size)
    counts[list(always)] = counts.max() + 1
    top = torch.topk(counts, size).indices
    return top.sort().values
