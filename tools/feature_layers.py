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
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from app import store
from app.distill import training
from app.distill.corpus import Sample, teacher_forced
from app.engine.drafting.adapter import Adapter
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

    def mapped(self, states: Tensor) -> Tensor:
        """`states` as the draft reads them: [.., dim], the layers' mapped, its own guesses as they are."""
        return self.proj(states) if states.shape[-1] != self.draft.config.dim else states

    def forward(self, states: Tensor, next_tokens: Tensor, adapter: Adapter | None = None) -> Tensor:
        return self.draft(self.mapped(states), next_tokens, adapter=adapter)

    def draft_logits(self, states: Tensor, adapter: Adapter | None = None) -> Tensor:
        return self.draft.draft_logits(states, adapter)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


@torch.inference_mode()
def layer_states(model, ids: list[Tensor], layers: list[int], batch_tokens: int = 8192) -> list[Tensor]:
    """Per sequence [n - 1, len(layers) * dim] (bf16): the chosen layers' outputs over its tokens but the last (-1:
    the final-normed last state), teacher-forced (`corpus.teacher_forced`, as the recipe computes its states)."""
    caught: dict[int, Tensor] = {}
    hooks = [
        model.layers[i].register_forward_hook(lambda m, a, out, i=i: caught.__setitem__(i, out))
        for i in layers
        if i >= 0
    ]

    def forward(x: Tensor) -> Tensor:
        last = model.hidden(x)
        return torch.cat([last if i < 0 else _rms(caught[i]) for i in layers], -1)

    try:
        return [f.clone() for f in teacher_forced(ids, forward, batch_tokens)]  # not views of whole batches
    finally:
        for h in hooks:
            h.remove()


def _goal_fixed(batch: training.Batch, dim: int) -> training.Batch:
    """A batch whose goal (the next position's states) keeps the final state's columns alone."""
    return training.Batch(batch.states, batch.next_tokens, batch.goal[..., -dim:].contiguous(), batch.weight)


def _loss(
    draft: EagleDraft | _Fused, batch: training.Batch, unroll: int, reg_weight: float
) -> tuple[Tensor, list[Tensor]]:
    """`training.unrolled_loss`, for either arm: position 0 reads its true state in every pass, mapped where the
    draft maps layers (the recipe's draft reads one state, which it keeps as it is)."""
    with torch.no_grad():
        teacher = torch.softmax(draft.draft_logits(batch.goal).float(), -1)
    fed, parts, agrees = batch.states, [], []
    first = draft.mapped(fed[:, :1]) if isinstance(draft, _Fused) else fed[:, :1]
    for _ in range(max(1, unroll)):
        part, agree, guess = training._pass_loss(draft, fed, batch, teacher, reg_weight, None)
        parts.append(part)
        agrees.append(agree)
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
