"""Memory in bytes: what a KV cache allocates, and what the machine has left for them.

The scheduler admits requests by the bytes their caches will hold (`Engine.kv_bytes`, built from
`kv_cache_bytes` and each drafter's `Drafter.session_bytes`), within a budget that defaults to a share of the
memory available when the server starts (`available_memory`): on the CPU the smaller of the kernel's
MemAvailable and what the process's cgroup (a container's limit) still allows, on a GPU its free memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.model.config import ModelConfig

# The share of the memory available at start-up that the KV caches may take by default. The rest is headroom
# for what admission does not count: a long prefill's activations (an 8k-token prompt peaks about 1.1 GB above
# idle in float32, docs/service.md#memory), the allocator's free lists, tokenizing, other processes.
AUTO_SHARE = 0.5

# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is no limit.
_NO_LIMIT = 1 << 60


def kv_cache_bytes(config: ModelConfig, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `capacity` positions for a model of `config` in `dtype` (keys and values of every
    layer, as `app.engine.model.cache.KVCache` allocates them, one sequence)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.n_layers * config.n_kv_heads * capacity * config.head_dim * itemsize


@dataclass(frozen=True)
class Available:
    """Memory a new allocation can take now, and where the figure comes from (for the log and /info)."""

    bytes: int
    source: str


def available_memory(device: torch.device, root: Path = Path("/")) -> Available | None:
    """What `device` has free now: on CUDA the device's free memory; elsewhere the smaller of MemAvailable
    (/proc/meminfo) and the process's cgroup limit less its usage (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), where one is set. None where none of them can be read (not Linux). `root`:
    where /proc and /sys are (tests)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return Available(int(free), "free CUDA memory")
    found = []
    meminfo = _meminfo_available(root / "proc" / "meminfo")
    if meminfo is not None:
        found.append(Available(meminfo, "MemAvailable"))
    cgroup = _cgroup_room(root)
    if cgroup is not None:
        found.append(cgroup)
    return min(found, key=lambda a: a.bytes) if found else None


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" where there is no limit


def _cgroup_room(root: Path) -> Available | None:
    """The process's cgroup memory limit less its usage, where a limit is set."""
    sys_cgroup = root / "sys" / "fs" / "cgroup"
    # v2: the process's own group (/proc/self/cgroup "0::/path"), then the root a container sees as its own.
    groups = [sys_cgroup]
    try:
        for line in (root / "proc" / "self" / "cgroup").read_text(encoding="ascii").splitlines():
            if line.startswith("0::/") and line[4:]:
                groups.insert(0, sys_cgroup / line[4:])
    except OSError:
        pass
    for group in groups:
        limit = _read_int(group / "memory.max")
        usage = _read_int(group / "memory.current")
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            return Available(max(0, limit - usage), "cgroup v2 memory.max less memory.current")
    v1 = sys_cgroup / "memory"
    limit = _read_int(v1 / "memory.limit_in_bytes")
    usage = _read_int(v1 / "memory.usage_in_bytes")
    if limit is not None and usage is not None and limit < _NO_LIMIT:
        return Available(max(0, limit - usage), "cgroup v1 memory.limit_in_bytes less memory.usage_in_bytes")
    return None


def auto_budget(device: torch.device, fallback: int, root: Path = Path("/")) -> tuple[int, str]:
    """The default KV-cache budget: `AUTO_SHARE` of what `available_memory` finds, or `fallback` where it finds
    nothing; with a line saying how it was chosen."""
    found = available_memory(device, root)
    if found is None:
        return fallback, "no memory figure readable here: the fallback"
    share = int(found.bytes * AUTO_SHARE)
    return share, f"{AUTO_SHARE:.0%} of the {format_bytes(found.bytes)} available ({found.source})"


def format_bytes(n: int) -> str:
    """`n` bytes for a message or a log line: in B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
