"""The draft learns from what it serves: per-tenant adapters of the feature draft, trained in the worker's idle time.

Every verification already computes the target's final state at each position, and a finished answer holds the
tokens the target chose: (states, tokens) is exactly what `specserve train-draft` trains on (app.distill.training),
for free. `DraftLearner` keeps the newest answers per tenant (`TraceBuffer`, bounded in bytes), and when the worker
has had nothing to do for a moment it fine-tunes that tenant's `Adapter` (app.engine.drafting.adapter: a low-rank
update of the fusion layer and a bias over the draft vocabulary, on the shipped weights, which stay as they are).

- Tenants: a request's tenant as the prefix cache and the index of earlier answers know it (its API key, refined by
  its cache_salt); one tenant's text never trains another's adapter, and an isolated request neither leaves a trace
  nor reads an adapter.
- Yielding: the worker calls `worker_busy` before it steps and `worker_idle` when it waits; training runs one short
  step at a time, each under a lock the worker takes back before its next forward, so a request that arrives waits
  for at most the step in flight (steps are sized to `step_seconds`).
- Never for the worse: the newest answers of a tenant are held back; a round's adapter replaces the tenant's current
  one only when it agrees with the target more often on them (top-1 at the draft's first token), else it is dropped.
- Exact as ever: an adapter changes what is drafted, never what is answered (greedy verification, the Gumbel
  sampler's noise); requests whose text depends on their drafts (the rejection sampler) read none.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import random
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from app.distill.corpus import Sample
from app.distill.training import Batch, batch_of, compute_dtype, unrolled_loss
from app.engine.drafting.adapter import DEFAULT_RANK, Adapter, draft_fingerprint
from app.engine.drafting.eagle import WEIGHTS_FILE, EagleDraft, EagleDrafter, read_draft
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.engine import Engine
from app.engine.kernels.quantized import QuantizedWeight
from app.engine.model.transformer import Transformer

log = logging.getLogger(__name__)

ADAPTER_SUFFIX = ".adapter.safetensors"
_SECRET_FILE = "tenant-key"
_WINDOW = 96  # positions per training row: one window of an answer (and the context just before it)
_MIN_WINDOW = 16
# Waits for the worker to have been idle long enough, then takes the step lock (False: the learner is stopping).
_Gate = Callable[[], bool]


@dataclass(frozen=True)
class LearningConfig:
    """How the learner keeps traces and trains.

    `memory_bytes`: the traces' bound, all tenants; `idle_seconds`: how long the worker must have been idle before
    training starts; `min_answers`: a tenant's answers since its last round before another; `steps`: optimizer steps
    per round; `step_seconds`: what one step may take (its positions are sized to it); `held_out`: the share of a
    tenant's newest answers kept for judging; `min_gain`: by how much a new adapter's agreement on them must beat
    the current one's; `max_tenants`: adapters held in memory (the least recently used go, and with a directory
    are read again when needed)."""

    memory_bytes: int = 64 << 20
    rank: int = DEFAULT_RANK
    idle_seconds: float = 0.5
    min_answers: int = 8
    steps: int = 60
    step_seconds: float = 0.008
    lr: float = 3e-3
    held_out: float = 0.25
    min_gain: float = 0.005
    max_tenants: int = 256
    seq_len: int = 384
    unroll: int = 2


def tenant_label(tenant: str | None) -> str:
    """A bounded label for metrics: the API key's name, else `shared` (no salt) or `salted` (a salt is a secret
    and unbounded: never a label)."""
    if tenant is None:
        return "shared"
    if tenant.startswith("key:"):
        return tenant[4:].split("|", 1)[0]
    return "salted"


class TraceBuffer:
    """The newest answers of each tenant, as training samples, within `max_bytes` in all: where it is full, the
    oldest answer of the tenant that holds most goes first (one busy tenant cannot push the others out)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._by_tenant: dict[str | None, deque[Sample]] = {}
        self._bytes_of: dict[str | None, int] = {}
        self.added: dict[str | None, int] = {}  # answers each tenant gave since it was last trained on

    @staticmethod
    def sample_bytes(sample: Sample) -> int:
        return sample.features.numel() * sample.features.element_size() + sample.tokens.numel() * 4

    def add(self, tenant: str | None, sample: Sample) -> None:
        size = self.sample_bytes(sample)
        if size > self.max_bytes:
            return
        self._by_tenant.setdefault(tenant, deque()).append(sample)
        self._bytes_of[tenant] = self._bytes_of.get(tenant, 0) + size
        self.added[tenant] = self.added.get(tenant, 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            fullest = max(self._bytes_of, key=lambda t: self._bytes_of[t])
            old = self._by_tenant[fullest].popleft()
            freed = self.sample_bytes(old)
            self._bytes_of[fullest] -= freed
            self.bytes -= freed
            if not self._by_tenant[fullest]:
                del self._by_tenant[fullest], self._bytes_of[fullest]

    def samples(self, tenant: str | None) -> list[Sample]:
        """The tenant's answers, oldest first."""
        return list(self._by_tenant.get(tenant, ()))

    @property
    def tenants(self) -> list[str | None]:
        return list(self._by_tenant)


@dataclass
class Round:
    """What one round of training a tenant's adapter gave."""

    tenant: str | None
    kept: bool
    before: float  # top-1 agreement on the held-back answers with the current adapter (or none)
    after: float  # the same with the new one
    seconds: float
    train_positions: int
    held_positions: int


@dataclass
class LearnerStats:
    """What /metrics shows (`DraftLearner.snapshot`): per tenant label (`tenant_label`)."""

    seconds: float = 0.0
    trace_bytes: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)


class DraftLearner:
    """Per-tenant adapters of one feature draft, learnt from the answers it serves (module docstring).

    `draft_dir`: the shipped draft's directory (its float32 weights are read again: the served copy is quantized);
    `target`: the loaded target (its embedding and output rows are borrowed, never trained); `directory`: where
    adapters persist across restarts (None: in memory only)."""

    def __init__(
        self,
        draft_dir: Path,
        target: Transformer,
        config: LearningConfig | None = None,
        directory: Path | None = None,
    ) -> None:
        self.config = config or LearningConfig()
        self.traces = TraceBuffer(self.config.memory_bytes)
        self.stats = LearnerStats()
        self._dtype = compute_dtype("auto", torch.device("cpu"))
        self._draft = _training_draft(draft_dir, target, self._dtype)
        # Which draft an adapter belongs to: hashed here, where adapters are made and read, not at every draft's load.
        self.fingerprint = draft_fingerprint(draft_dir / WEIGHTS_FILE)
        self._adapters: OrderedDict[str, Adapter] = OrderedDict()  # by tenant digest, most recently used last
        self._digests: OrderedDict[str | None, str] = OrderedDict()
        self._directory = directory
        self._secret = _tenant_secret(directory) if directory is not None else secrets.token_bytes(32)
        self._positions = 256  # per training step, resized to step_seconds as steps are timed
        self._lock = threading.Lock()  # held by a training step, and by the worker while it steps
        self._stats_lock = threading.Lock()  # the traces and the figures, shared with the worker and /metrics
        self._idle_since: float | None = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(0)

    # --- what the worker calls --------------------------------------------------------------------------

    def observe(self, tenant: str | None, features: Tensor, ids: Sequence[int], prompt_len: int) -> None:
        """A finished answer: `features` [>= len(ids) - 1, dim] the target's state of each position, `ids` the
        whole sequence, prompt first. Copies what it keeps (the buffers are the request's)."""
        n = len(ids)
        if n - prompt_len < 2 or features.shape[0] < n - 1:
            return
        start = max(0, n - 1 - self.config.seq_len)
        sample = Sample(
            torch.tensor(list(ids[start:n]), dtype=torch.int32),
            features[start : n - 1].detach().to(torch.bfloat16).clone(),
            max(0, prompt_len - start),
        )
        with self._stats_lock:
            self.traces.add(tenant, sample)
        self._wake.set()

    def adapter(self, tenant: str | None) -> Adapter | None:
        """The tenant's current adapter, or None (its drafts are the shipped draft's)."""
        digest = self._digests.get(tenant)
        if digest is None:
            digest = hmac.new(self._secret, (tenant or "").encode(), hashlib.sha256).hexdigest()[:32]
            self._digests[tenant] = digest
            while len(self._digests) > 4 * self.config.max_tenants:
                self._digests.popitem(last=False)
        return self._adapters.get(digest)

    def worker_busy(self) -> None:
        """The worker has work: no training step starts until `worker_idle`, and one in flight is waited for."""
        self._idle_since = None
        with self._lock:
            pass

    def worker_idle(self) -> None:
        """The worker waits for work: training may start after `idle_seconds`."""
        self._idle_since = time.monotonic()
        self._wake.set()

    def snapshot(self) -> LearnerStats:
        """A copy of the figures, the traces' bytes included."""
        with self._stats_lock:
            s = self.stats
            return LearnerStats(
                s.seconds, self.traces.bytes, dict(s.kept), dict(s.dropped), dict(s.before), dict(s.after)
            )

    # --- the trainer thread ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread that trains while the worker is idle."""
        if self._thread is None:
            self._load_saved()
            self._thread = threading.Thread(target=self._run, name="draft-learner", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            tenant = self.due()
            if tenant is None:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self.train_round(tenant, gate=self._gate)
            except Exception:  # a failed round loses that round, never the server
                log.exception("draft learning: a round failed; the tenant's adapter is unchanged")

    def _gate(self) -> bool:
        """Wait until the worker has been idle for `idle_seconds` (False: the learner is stopping), then take the
        step lock; the caller releases it after one step."""
        while not self._stop.is_set():
            since = self._idle_since
            if since is not None and time.monotonic() - since >= self.config.idle_seconds:
                self._lock.acquire()
                if self._idle_since is not None:  # the worker did not wake meanwhile
                    return True
                self._lock.release()
            time.sleep(0.02)
        return False

    def due(self) -> str | None:
        """The tenant with most new answers, when it has at least `min_answers` of them (else None)."""
        with self._stats_lock:
            ready = [(n, t) for t, n in self.traces.added.items() if n >= self.config.min_answers]
        if not ready:
            return None
        return max(ready, key=lambda p: p[0])[1]

    # --- a round ------------------------------------------------------------------------------------------

    def train_round(self, tenant: str | None, gate: _Gate | None = None) -> Round | None:
        """Train a new adapter for `tenant` from its current one on its answers but the newest, judge both on those,
        keep the better. `gate`: called before each step, which then runs under the learner's lock (None: run
        straight through, as the bench does). None when the tenant has too few answers to judge by."""
        cfg = self.config
        with self._stats_lock:
            samples = self.traces.samples(tenant)
            self.traces.added[tenant] = 0
        held_n = max(1, math.ceil(len(samples) * cfg.held_out))
        train, held = samples[:-held_n], samples[-held_n:]
        if not train:
            return None
        t0 = time.perf_counter()
        busy = 0.0
        current = self.adapter(tenant)
        new = current.clone() if current is not None else self._fresh()
        for p in new.parameters():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(new.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        trained = 0
        for step in range(cfg.steps):
            batch = self._batch(train)
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            for g in opt.param_groups:
                g["lr"] = lr
            with _stepping(gate, self._lock) as ran:
                if not ran:
                    return None
                s0 = time.perf_counter()
                loss = self._loss(batch, new)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(new.parameters(), 1.0)
                opt.step()
                took = time.perf_counter() - s0
            busy += took
            trained += int(batch.weight.sum())
            self._resize(took)
        for p in new.parameters():
            p.requires_grad_(False)
        before = after = 0.0
        positions = 0
        for batch in self._held_batches(held):
            # Each adapter's judging a step of its own: a step is what a request arriving mid-training waits for.
            n, goal = int(batch.weight.sum()), None
            for which in (current, new):
                with _stepping(gate, self._lock) as ran:
                    if not ran:
                        return None
                    s0 = time.perf_counter()
                    agree, goal = self._agreement(batch, which, goal)
                    busy += time.perf_counter() - s0
                if which is current:
                    before += agree * n
                else:
                    after += agree * n
            positions += n
        if positions == 0:
            return None
        before, after = before / positions, after / positions
        kept = after > before + cfg.min_gain
        if kept:
            self._keep(tenant, new)
        label = tenant_label(tenant)
        with self._stats_lock:
            self.stats.seconds += busy
            counts = self.stats.kept if kept else self.stats.dropped
            counts[label] = counts.get(label, 0) + 1
            self.stats.before[label], self.stats.after[label] = before, after
        result = Round(tenant, kept, before, after, time.perf_counter() - t0, trained, positions)
        log.info(
            "draft learning (%s): agreement %.3f -> %.3f on %d held-back positions, adapter %s",
            label,
            before,
            after,
            positions,
            "kept" if kept else "dropped",
        )
        return result

    def _fresh(self) -> Adapter:
        d = self._draft.config
        return Adapter.zeros(d.dim, d.draft_vocab_size, self.fingerprint, self.config.rank, self._rng.randrange(2**31))

    def _width(self) -> int:
        """Positions per row of a step: `_WINDOW`, fewer where a step must be smaller than one such row."""
        return min(_WINDOW, max(_MIN_WINDOW, self._positions))

    def _batch(self, samples: list[Sample]) -> Batch:
        """About `_positions` training positions: windows of answers drawn from `samples`, each where the answer
        is (position p counts when token p+2 is the answer's)."""
        width = self._width()
        windows = []
        for _ in range(max(1, self._positions // width)):
            s = self._rng.choice(samples)
            last = s.features.shape[0] - 1  # a window [a, b) needs the state b for its goal
            w = min(width, last)
            first = max(0, min(s.prompt_len - 2 - w // 2, last - w))
            a = self._rng.randint(first, last - w)
            windows.append((s, a, a + w))
        return batch_of(windows, width)

    def _held_batches(self, samples: list[Sample]) -> Iterator[Batch]:
        """The answers of `samples` in consecutive windows (each position judged once), a step's worth at a time."""
        width = self._width()
        windows = []
        for s in samples:
            last = s.features.shape[0] - 1
            for a in range(max(0, s.prompt_len - 2), last, width):
                windows.append((s, a, min(a + width, last)))
        rows = max(1, self._positions // width)
        for i in range(0, len(windows), rows):
            yield batch_of(windows[i : i + rows], width)

    def _resize(self, took: float) -> None:
        """Positions per step toward `step_seconds` (a step is what a request arriving mid-training waits for)."""
        scale = min(2.0, max(0.5, self.config.step_seconds / max(took, 1e-6)))
        self._positions = int(min(4096, max(_MIN_WINDOW, self._positions * scale)))

    def _loss(self, batch: Batch, adapter: Adapter) -> Tensor:
        """train-draft's loss (app.distill.training.unrolled_loss) through the adapter, without the state regression:
        the adapter is judged by the tokens it makes the draft choose."""
        batch = batch.to(torch.device("cpu"), self._dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._dtype == torch.bfloat16):
            return unrolled_loss(self._draft, batch, self.config.unroll, 0.0, adapter)[0]

    @torch.no_grad()
    def _agreement(self, batch: Batch, adapter: Adapter | None, goal: Tensor | None = None) -> tuple[float, Tensor]:
        """Top-1 agreement of the draft's first token with the target's choice on the batch's answer positions, and
        the target's choices (long [B, T]; pass them back as `goal` to judge another adapter on the same batch)."""
        batch = batch.to(torch.device("cpu"), self._dtype)
        draft = self._draft
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._dtype == torch.bfloat16):
            if goal is None:
                goal = draft.draft_logits(batch.goal).float().argmax(-1)
            guess = draft.draft_logits(draft(batch.states, batch.next_tokens, adapter=adapter), adapter)
        w = batch.weight
        return float(((guess.float().argmax(-1) == goal).float() * w).sum() / w.sum().clamp_min(1)), goal

    # --- keeping and persistence ---------------------------------------------------------------------------

    def _keep(self, tenant: str | None, adapter: Adapter) -> None:
        self.adapter(tenant)  # its digest
        digest = self._digests[tenant]
        self._adapters[digest] = adapter
        self._adapters.move_to_end(digest)
        while len(self._adapters) > self.config.max_tenants:
            self._adapters.popitem(last=False)
        if self._directory is not None:
            try:
                adapter.save(self._directory / f"{digest}{ADAPTER_SUFFIX}")
            except OSError as exc:
                log.warning("draft learning: cannot save an adapter in %s: %s", self._directory, exc)

    def _load_saved(self) -> None:
        """Adapters a previous run kept for this draft (the newest `max_tenants`); others are left alone."""
        if self._directory is None:
            return
        files = sorted(self._directory.glob(f"*{ADAPTER_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files[-self.config.max_tenants :]:
            try:
                adapter = Adapter.load(path)
            except ValueError as exc:
                log.warning("draft learning: %s", exc)
                continue
            if adapter.draft != self.fingerprint:
                continue  # trained on another draft
            self._adapters[path.name.removesuffix(ADAPTER_SUFFIX)] = adapter
        if self._adapters:
            log.info("draft learning: %d tenant adapters read from %s", len(self._adapters), self._directory)


class _stepping:
    """`with _stepping(gate, lock) as ran`: waits for `gate` (which takes `lock`) and releases the lock after the
    block; `ran` False when the gate refused (the learner stops). Without a gate the block just runs."""

    def __init__(self, gate: _Gate | None, lock: threading.Lock) -> None:
        self._gate, self._lock, self._held = gate, lock, False

    def __enter__(self) -> bool:
        if self._gate is None:
            return True
        self._held = self._gate()
        return self._held

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._lock.release()


def feature_drafter(engine: Engine) -> EagleDrafter | None:
    """The engine's feature draft that a learner can train (loaded from a directory): a drafter of its own, or the
    model half of a hybrid; None where there is none."""
    for drafter in engine.drafters.values():
        model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
        if isinstance(model, EagleDrafter) and model.draft.source is not None:
            return model
    return None


def _training_draft(draft_dir: Path, target: Transformer, dtype: torch.dtype) -> EagleDraft:
    """The draft as it was saved, frozen, in `dtype` (what training computes in: its frozen weights are not cast
    again at every product, which cost a step more than its arithmetic), its borrowed output rows as plain rows (the
    served copy's are quantized or packed, which autograd cannot pass through)."""
    draft = read_draft(draft_dir).to(dtype).eval().requires_grad_(False)
    draft.attach(target, pack=False)
    draft.__dict__["_head"] = None
    rows = target.head_rows(draft.vocab_ids)
    draft._head_rows = (rows.dequantize() if isinstance(rows, QuantizedWeight) else rows).to(dtype)
    return draft


def _tenant_secret(directory: Path) -> bytes:
    """The key adapter file names are derived with (a tenant's salt is a secret: its digest is keyed), made once."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / _SECRET_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    secret = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret
