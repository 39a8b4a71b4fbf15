"""Memory in bytes: what `Engine.kv_bytes` says a request holds is what its started generation allocates (every
drafter's session included), and the default budget reads the memory the machine (or its container) has left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from app.engine.drafting.base import Drafter
from app.engine.drafting.eagle import EagleConfig, EagleDraft, EagleDrafter
from app.engine.drafting.hybrid import HybridDrafter
from app.engine.drafting.model import ModelDrafter
from app.engine.drafting.ngram import NgramDrafter
from app.engine.engine import Engine
from app.engine.generation import Generation
from app.engine.memory import AUTO_SHARE, auto_budget, available_memory, format_bytes
from app.engine.model.loading import LoadedModel
from app.engine.step import GenerationParams
from tests.conftest import FIXED_DRAFT

V = 64


def _engine(make_tiny_model, truncate_layers, word_tokenizer, verify_width: int | None = None) -> Engine:
    tok = word_tokenizer(V)
    target = make_tiny_model(seed=1, vocab_size=V)
    loaded = LoadedModel(target, tok, "target", 0.0)
    small = ModelDrafter("small", LoadedModel(truncate_layers(target, 1), tok, "small", 0.0), loaded)
    # A draft whose context is shorter than the target's: its cache stops at its own context.
    short = make_tiny_model(seed=2, vocab_size=V, n_layers=1, max_seq_len=40)
    eagle = EagleDraft(EagleConfig.for_target(target.config, V, "tiny")).eval().requires_grad_(False)
    eagle.attach(target)
    drafters: dict[str, Drafter] = {
        "small": small,
        "short": ModelDrafter("short", LoadedModel(short, tok, "short", 0.0), loaded),
        "hybrid": HybridDrafter("hybrid", small),
        "eagle": EagleDrafter("eagle", eagle, loaded),
        "eagle-hybrid": HybridDrafter("eagle-hybrid", EagleDrafter("eagle", eagle, loaded)),
        "ngram": NgramDrafter(),
    }
    return Engine(target, tok, drafters, "small", 4, verify_width, **FIXED_DRAFT)


def _shared(engine: Engine) -> set[int]:
    """The storages of the loaded models' weights and buffers, which sessions may refer to but do not allocate."""
    modules = [engine.target]
    for drafter in engine.drafters.values():
        modules += [m for m in vars(drafter).values() if isinstance(m, nn.Module)]
        inner = getattr(drafter, "model", None)
        if isinstance(inner, Drafter):
            modules += [m for m in vars(inner).values() if isinstance(m, nn.Module)]
    return {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}


def _allocated(gen: Generation, shared: set[int]) -> int:
    """Bytes of every tensor a generation holds (through its caches and draft session), not counting the models'."""
    seen: set[int] = set()
    storages: dict[int, int] = {}

    def walk(obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in shared:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, nn.Module | Drafter):
            return  # loaded once, shared by every request
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list | tuple | set | frozenset):
            for value in obj:
                walk(value)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value)

    walk(gen)
    return sum(storages.values())


@pytest.mark.parametrize("verify_width", [None, 8])
@pytest.mark.parametrize("draft", ["none", "small", "short", "hybrid", "eagle", "eagle-hybrid", "ngram"])
def test_kv_bytes_is_what_a_started_generation_allocates(
    make_tiny_model, truncate_layers, word_tokenizer, draft: str, verify_width: int | None
) -> None:
    engine = _engine(make_tiny_model, truncate_layers, word_tokenizer, verify_width)
    shared = _shared(engine)
    context = engine.target.config.max_seq_len
    # Short and long (the capacity capped by the context), with a draft and without (k = 0: no draft session).
    for prompt_len, max_new, k in [(5, 20, 4), (30, 60, 16), (200, 56, 2), (250, 6, 4), (9, 3, 0)]:
        assert prompt_len + max_new <= context
        gen = engine.start(
            [i % V for i in range(prompt_len)], GenerationParams(max_new_tokens=max_new, num_draft_tokens=k), draft
        )
        expected = engine.kv_bytes(prompt_len, max_new, draft, k)
        assert _allocated(gen, shared) == expected, (prompt_len, max_new, k)
        assert expected >= gen.cache.k.nbytes * 2 > 0
        if draft in ("small", "eagle", "hybrid") and k:
            assert expected > gen.cache.k.nbytes * 2, "the draft's session counts"


def test_kv_bytes_refuses_an_unknown_draft(make_tiny_model, truncate_layers, word_tokenizer) -> None:
    from app.engine.step import GenerationError

    engine = _engine(make_tiny_model, truncate_layers, word_tokenizer)
    with pytest.raises(GenerationError, match="unknown draft"):
        engine.kv_bytes(4, 4, "nope")


# --- what the machine has left ------------------------------------------------------------------------------

GiB = 2**30


def _machine(tmp_path: Path, meminfo_kb: int | None = None, cgroup: str | None = None, v1: bool = False) -> Path:
    """A fake root with /proc/meminfo and a cgroup limit (v2 in the process's own group, or v1) as given."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    if meminfo_kb is not None:
        (tmp_path / "proc" / "meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemFree:         1000 kB\nMemAvailable:   {meminfo_kb} kB\n"
        )
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/system.slice/specserve.service\n")
    group = tmp_path / "sys" / "fs" / "cgroup" / "system.slice" / "specserve.service"
    group.mkdir(parents=True)
    if cgroup is not None and not v1:
        limit, usage = cgroup.split("/")
        (group / "memory.max").write_text(f"{limit}\n")
        (group / "memory.current").write_text(f"{usage}\n")
    if cgroup is not None and v1:
        limit, usage = cgroup.split("/")
        memory = tmp_path / "sys" / "fs" / "cgroup" / "memory"
        memory.mkdir(parents=True)
        (memory / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (memory / "memory.usage_in_bytes").write_text(f"{usage}\n")
    return tmp_path


CPU = torch.device("cpu")


def test_available_memory_is_memavailable_or_the_cgroups_room_whichever_is_less(tmp_path: Path) -> None:
    meminfo = available_memory(CPU, _machine(tmp_path / "a", meminfo_kb=8 * 2**20))
    assert meminfo is not None and (meminfo.bytes, meminfo.source) == (8 * GiB, "MemAvailable")
    # A container limited to 4 GiB, 1 GiB of it used: 3 GiB, less than the host's 8.
    docker = available_memory(CPU, _machine(tmp_path / "b", meminfo_kb=8 * 2**20, cgroup=f"{4 * GiB}/{GiB}"))
    assert docker is not None and docker.bytes == 3 * GiB and "memory.max" in docker.source
    v1 = available_memory(CPU, _machine(tmp_path / "c", meminfo_kb=8 * 2**20, cgroup=f"{2 * GiB}/{GiB}", v1=True))
    assert v1 is not None and v1.bytes == GiB and "v1" in v1.source
    # No limit ("max"; v1's huge number), or a limit above what the host has: MemAvailable.
    for root in (
        _machine(tmp_path / "d", meminfo_kb=8 * 2**20, cgroup=f"max/{GiB}"),
        _machine(tmp_path / "e", meminfo_kb=8 * 2**20, cgroup=f"9223372036854771712/{GiB}", v1=True),
        _machine(tmp_path / "f", meminfo_kb=8 * 2**20, cgroup=f"{64 * GiB}/{GiB}"),
    ):
        found = available_memory(CPU, root)
        assert found is not None and found.bytes == 8 * GiB, root
    # A cgroup limit where /proc/meminfo is unreadable; nothing readable at all.
    only = available_memory(CPU, _machine(tmp_path / "g", cgroup=f"{4 * GiB}/{GiB}"))
    assert only is not None and only.bytes == 3 * GiB
    assert available_memory(CPU, _machine(tmp_path / "h")) is None


def test_the_auto_budget_is_a_share_of_what_is_available_else_the_fallback(tmp_path: Path) -> None:
    budget, how = auto_budget(CPU, 123, _machine(tmp_path / "a", meminfo_kb=8 * 2**20, cgroup=f"{4 * GiB}/{GiB}"))
    assert budget == int(3 * GiB * AUTO_SHARE) and "3.0 GiB" in how and "cgroup" in how
    assert auto_budget(CPU, 123, _machine(tmp_path / "b")) == (123, "no memory figure readable here: the fallback")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * GiB)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]
