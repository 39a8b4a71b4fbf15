"""Issue 68's untried lever, measured small: does a feature draft that reads a low, a middle and the last layer's
states (EAGLE-3's fusion) agree with the target more often than one that reads the last layer's alone, on the same
data and training budget?

Both arms are the shipped architecture (`EagleDraft`: fusion of [embedding | state], one decoder layer, the target's
output rows for the draft vocabulary), trained from scratch with the recipe's loss (app.distill.training: soft labels
from the target's next state, a small regression onto it, unrolled passes that read the draft's own guesses) on the
same corpus samples, batches, seed and steps. The fused arm first maps [low | middle | last] (the low and middle
layers' residual streams RMS-normalised, the last one final-normed as the shipped draft reads it) to one state
with a learned linear layer; its later passes read its own guesses, as EAGLE-3's do. Held-out samples of the corpus
give top-1 agreement with the target at depths 1-3 (true states, then one and two of its own guesses).

    .venv/bin/python tools/feature_layers.py --train 600 --held-out 60 --steps 120

Reads model_store/corpus/smollm2-135m-instruct (token ids only: the states are computed here, never written into
the repository).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import store
from app.distill import training
from app.engine.drafting.eagle import EagleConfig, EagleDraft
from app.engine.model.loading import load_model

CORPUS = Path(__file__).resolve().parents[1] / "model_store" / "corpus" / "smollm2-135m-instruct"


class _Fused(nn.Module):
    """An EagleDraft reading `n` layers' states [.., n * dim] through a learned map to one [.., dim]; states of
    width dim (its own guesses) go in as they are."""

    def __init__(self, draft: EagleDraft, n: int) -> None:
        super().__init__()
        self.draft = draft
        dim = draft.config.dim
        self.proj = nn.Linear(n * dim, dim, bias=False)
        with torch.no_grad():  # start as the last layer's state alone: the single-layer arm's starting point
            self.proj.weight.zero_()
            self.proj.weight[:, (n - 1) * dim :] = torch.eye(dim)

    def forward(self, states: Tensor, next_tokens: Tensor) -> Tensor:
        if states.shape[-1] != self.draft.config.dim:
            states = self.proj(states)
        return self.draft(states, next_tokens)

    def draft_logits(self, states: Tensor) -> Tensor:
        return self.draft.draft_logits(states)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


@torch.inference_mode()
def layer_states(model, ids: list[Tensor], layers: list[int], batch_tokens: int = 8192) -> list[Tensor]:
    """Per sequence [n - 1, len(layers) * dim] (bf16): the chosen layers' outputs over its tokens but the last (-1:
    the final-normed last state), teacher-forced, one forward per batch of similar lengths."""
    caught: dict[int, Tensor] = {}
    hooks = [
        model.layers[i].register_forward_hook(lambda m, a, out, i=i: caught.__setitem__(i, out))
        for i in layers
        if i >= 0
    ]
    out: list[Tensor | None] = [None] * len(ids)
    order = sorted(range(len(ids)), key=lambda j: len(ids[j]))
    k = 0
    try:
        while k < len(order):
            width = len(ids[order[k]]) - 1
            group = order[k : k + max(1, batch_tokens // max(width, 1))]
            width = max(len(ids[j]) - 1 for j in group)
            x = torch.zeros(len(group), width, dtype=torch.long)
            for r, j in enumerate(group):
                x[r, : len(ids[j]) - 1] = ids[j][:-1].long()
            last = model.hidden(x)
            parts = [last if i < 0 else _rms(caught[i]) for i in layers]
            both = torch.cat(parts, -1)
            for r, j in enumerate(group):
                out[j] = both[r, : len(ids[j]) - 1].to(torch.bfloat16).clone()
            k += len(group)
    finally:
        for h in hooks:
            h.remove()
    return [o for o in out if o is not None]


def _goal_fixed(batch: training.Batch, dim: int) -> training.Batch:
    """A batch whose goal (the next position's states) keeps the final state's columns alone."""
    return training.Batch(batch.states, batch.next_tokens, batch.goal[..., -dim:].contiguous(), batch.weight)


def _loss(draft, batch: training.Batch, unroll: int, reg_weight: float) -> tuple[Tensor, list[Tensor]]:
    with torch.no_grad():
        teacher = torch.softmax(draft.draft_logits(batch.goal).float(), -1)
    fed, parts, agrees = batch.states, [], []
    first = None
    w = batch.weight
    for _ in range(max(1, unroll)):
        guess = draft(fed, batch.next_tokens)
        logp = F.log_softmax(draft.draft_logits(guess).float(), -1)
        ce = (-(teacher * logp).sum(-1) * w).sum() / w.sum().clamp_min(1)
        reg = F.smooth_l1_loss(guess.float(), batch.goal.float(), reduction="none").mean(-1)
        reg = (reg * w).sum() / w.sum().clamp_min(1)
        parts.append(ce + reg_weight * reg)
        agrees.append(((logp.argmax(-1) == teacher.argmax(-1)).float() * w).sum() / w.sum().clamp_min(1))
        if first is None:  # position 0 has no guess before it: it reads its true (mapped) state in every pass
            first = fed[:, :1] if fed.shape[-1] == guess.shape[-1] else draft.proj(fed[:, :1])
        fed = torch.cat([first.to(guess.dtype), guess[:, :-1]], dim=1)
    return torch.stack(parts).sum(), agrees


def run_arm(name, draft, samples, held, cfg: training.TrainConfig, dim: int) -> dict:
    torch.manual_seed(cfg.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    batches: list[training.Batch] = []
    t0 = time.perf_counter()
    draft.train()
    for step in range(cfg.steps):
        if not batches:
            batches = training.make_batches(samples, cfg, rng)
        batch = _goal_fixed(batches.pop(), dim)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, agrees = _loss(draft, batch, cfg.unroll, cfg.regression_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg.steps - 1:
            print(f"{name} step {step} loss {loss.item():.3f} agree {[round(a.item(), 3) for a in agrees]}", flush=True)
    seconds = time.perf_counter() - t0
    draft.eval()
    sums = [0.0] * cfg.unroll
    weight = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in training.make_batches(held, cfg, random.Random(1)):
            batch = _goal_fixed(batch, dim)
            _, agrees = _loss(draft, batch, cfg.unroll, cfg.regression_weight)
            n = float(batch.weight.sum())
            sums = [s + a.item() * n for s, a in zip(sums, agrees, strict=True)]
            weight += n
    return {
        "arm": name,
        "held_out_top1": [round(s / weight, 4) for s in sums],
        "positions": weight,
        "train_seconds": round(seconds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", type=int, default=600, help="corpus sequences to train on")
    ap.add_argument("--held-out", type=int, default=60, help="corpus sequences to measure on (never trained on)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", default="2,15,-1", help="low, middle, last (-1: the final-normed last state)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    loaded = load_model(
        store.resolve("smollm2-135m-instruct"), "bfloat16", "cpu", cache_dir=store.cache_dir(), weights="bf16"
    )
    model = loaded.model
    seqs: list[tuple[Tensor, int]] = []
    for path in sorted(p for p in CORPUS.glob("r*.pt") if not p.name.endswith(".features.pt")):
        d = torch.load(path, weights_only=True)
        off = 0
        for n, p in zip(d["lengths"].tolist(), d["prompt_lens"].tolist(), strict=True):
            seqs.append((d["tokens"][off : off + n], p))
            off += n
    random.Random(args.seed).shuffle(seqs)
    chosen = seqs[: args.train + args.held_out]
    layers = [int(x) for x in args.layers.split(",")]
    t0 = time.perf_counter()
    states = layer_states(model, [s for s, _ in chosen], layers)
    print(f"states of {sum(x.shape[0] for x in states)} positions, layers {layers}: {time.perf_counter() - t0:.0f} s")
    dim = model.config.dim
    from app.distill.corpus import Sample

    fused = [Sample(s, f, p) for (s, p), f in zip(chosen, states, strict=True)]
    single = [Sample(s, f[:, -dim:].contiguous(), p) for (s, p), f in zip(chosen, states, strict=True)]
    n = args.train
    eos = sorted(loaded.tokenizer.eos_token_ids)
    vocab = training.choose_vocab(single[:n], args.draft_vocab, model.config.vocab_size, eos)
    cfg = training.TrainConfig(steps=args.steps, lr=args.lr, seq_len=512, tokens_per_batch=4096, seed=args.seed)
    results = []
    for name in ("last layer", f"layers {args.layers}"):
        torch.manual_seed(args.seed)
        draft = EagleDraft(EagleConfig.for_target(model.config, len(vocab), "experiment"))
        draft.vocab_ids.copy_(vocab)
        draft.attach(model)
        if name == "last layer":
            arm, data = draft, single
        else:
            arm, data = _Fused(draft, len(layers)), fused
        results.append(run_arm(name, arm, data[:n], data[n:], cfg, dim))
        print(json.dumps(results[-1]), flush=True)
    answer = sum(len(s) - p for s, p in chosen[:n])
    print(json.dumps({"train_sequences": n, "answer_tokens": answer, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
