"""A real `specserve serve` process for the tests that need one (on 127.0.0.1, a free port), and /metrics reads.

Test modules import it as `_server` (pytest puts tests/ on sys.path: the directory has no __init__.py).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The shared server's limits (`shared_server_args`): room for 2 running requests and 1 waiting, 2 s to send a body.
MAX_RUNNING, MAX_WAITING = 2, 1
BODY_READ_TIMEOUT = 2


def shared_server_args() -> list[str]:
    """The flags of the one server the modules that need only a server share (conftest's `real_server`): the
    float32 target, the default draft, the limits above."""
    return [
        "--dtype", "float32",
        "--max-concurrent-requests", str(MAX_RUNNING),
        "--max-queue-size", str(MAX_WAITING),
        "--body-read-timeout", str(BODY_READ_TIMEOUT),
        "--log-level", "warning",
    ]  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specserve_command() -> list[str]:
    """The `specserve` command of this interpreter's environment."""
    script = Path(sys.executable).with_name("specserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


@dataclass(frozen=True)
class ServerProcess:
    """A started server: its base URL, its process and its log."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def running_server(
    log: Path, *args: str, env: Mapping[str, str] | None = None, ready_within: float = 180
) -> Iterator[str]:
    """`specserve serve --host 127.0.0.1 --port <free> *args`, its output in `log`; yields its base URL once
    /health is 200, and stops it afterwards. Fails the test, with the log's end, if it exits or is not ready."""
    with server_process(log, *args, env=env, ready_within=ready_within) as server:
        yield server.url


@contextlib.contextmanager
def server_process(
    log: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    ready_within: float = 180,
    command: Sequence[str] | None = None,
) -> Iterator[ServerProcess]:
    """As `running_server`, yielding the process too (for a test that signals it); `command` replaces the
    `specserve` command (a wrapper taking the same arguments)."""
    port = free_port()
    argv = [*(command or specserve_command()), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within
        while True:
            if proc.poll() is not None:
                pytest.fail(f"specserve serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"specserve serve was not ready in {ready_within:g} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield ServerProcess(url, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(url: str, name: str, **labels: str) -> float:
    """The value of the one sample of the server's /metrics named `name` whose labels include `labels` (the
    label model_name, on every sample, need not be given); 0 when there is none."""
    found = [
        sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else 0.0
