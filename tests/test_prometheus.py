"""The real Prometheus, on our scrape configuration, reads a real specserve's acceptance rate.

`prometheus` (Debian package prometheus, which .ci/run installs) runs on 127.0.0.1 with
docker/prometheus/prometheus.yml, its target rewritten from the compose service to the test's server and its
interval shortened to 1 s. After a few generations that the n-gram draft partly predicts, the dashboard's
acceptance-rate query, asked of Prometheus, equals accepted / drafted read from /metrics directly, and every
other query of the dashboard returns data. Under CI a missing binary fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _server import free_port, metric, running_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "specserve.json").read_text())
ACCEPTED = "specserve_spec_decode_num_accepted_tokens_total"
DRAFTED = "specserve_spec_decode_num_draft_tokens_total"


def _prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI (Debian package prometheus)")
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    return binary


def _scrape_config(target: str) -> dict:
    """Our configuration, scraping `target` every second instead of the compose containers every 5 s."""
    config = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "specserve"]
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, target_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(specserve URL, Prometheus URL, specserve's log): a fresh server, and Prometheus scraping it."""
    binary = _prometheus()
    tmp = tmp_path_factory.mktemp("prometheus")
    log = tmp / "specserve.log"
    with running_server(log, "--dtype", "float32", "--log-format", "json", "--log-level", "info") as server:
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(_scrape_config(server.removeprefix("http://"))))
        prom_url = f"http://127.0.0.1:{free_port()}"
        prom_log = tmp / "prometheus.log"
        command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address={prom_url.removeprefix('http://')}",
            "--log.level=warn",
        ]
        with prom_log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited with {proc.returncode}:\n{prom_log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{prom_url}/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"prometheus was not ready:\n{prom_log.read_text()[-3000:]}"
                time.sleep(0.2)
            yield server, prom_url, log
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _value(prom: str, expr: str) -> float | None:
    result = _query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def _wait_for(prom: str, expr: str, want: float, what: str) -> None:
    deadline = time.monotonic() + 15
    while _value(prom, expr) != want:
        assert time.monotonic() < deadline, f"Prometheus did not see {what}: {_value(prom, expr)} != {want}"
        time.sleep(0.2)


def _dashboard_expr(expr: str) -> str:
    """A dashboard query as Grafana sends it with every replica selected."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "1m")


def test_prometheus_reads_the_acceptance_rate(stack: tuple[str, str, Path]) -> None:
    server, prom, log = stack
    # A first scrape of the fresh server (counters at 0) before anything is generated.
    _wait_for(prom, 'up{job="specserve"}', 1.0, "the server up")
    _wait_for(prom, DRAFTED, 0.0, "the counters")

    repeat = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the quiet river bank."
    requests = [
        ("/generate", {"inputs": "a b c d a b c d a b c d a b", "parameters": {"max_new_tokens": 16}}),
        ("/v1/chat/completions", {"max_tokens": 24, "messages": [{"role": "user", "content": repeat}]}),
        ("/generate", {"inputs": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "parameters": {"max_new_tokens": 16}}),
    ]
    for i, (path, body) in enumerate(requests):
        r = httpx.post(f"{server}{path}", json=body, headers={"X-Request-ID": f"prom-test-{i}"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == f"prom-test-{i}"
    accepted, drafted = metric(server, ACCEPTED), metric(server, DRAFTED)
    assert drafted > 0 and 0 < accepted <= drafted
    _wait_for(prom, DRAFTED, drafted, "the drafted tokens")
    _wait_for(prom, ACCEPTED, accepted, "the accepted tokens")

    [panel] = [p for p in DASHBOARD["panels"] if p["title"] == "Acceptance rate, last 5 min"]
    [target] = panel["targets"]
    rate = _value(prom, _dashboard_expr(target["expr"]))
    assert rate is not None and 0.0 <= rate <= 1.0
    assert rate == pytest.approx(accepted / drafted, rel=1e-6)

    # Every other query of the dashboard is valid PromQL for this Prometheus and shows data.
    for p in DASHBOARD["panels"]:
        for t in p["targets"]:
            assert _query(prom, _dashboard_expr(t["expr"])), f"{p['title']}: no data for {t['expr']}"
    instances = httpx.get(
        f"{prom}/api/v1/label/instance/values", params={"match[]": "specserve_target_passes_total"}
    ).json()["data"]
    assert instances == [server.removeprefix("http://")]

    # The server's JSON log carries each request's id, on the access line too.
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [e for e in lines if e["logger"] == "uvicorn.access" and e.get("request_id") == "prom-test-0"]
    assert access and "POST /generate" in access[0]["message"]


def test_container_healthcheck_passes_on_a_ready_server(
    stack: tuple[str, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    server, _, _ = stack
    spec = importlib.util.spec_from_file_location("docker_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    monkeypatch.setenv("SPECSERVE_PORT", server.rsplit(":", 1)[1])
    assert healthcheck.main() == 0
