"""The real Prometheus, on our scrape configuration, reads a real specserve's acceptance rate.

`prometheus` (Debian package prometheus, which .ci/run installs) runs on 127.0.0.1 with
docker/prometheus/prometheus.yml, its target rewritten from the compose service to the test's server, its
interval shortened to 1 s and its credentials file one of the test's. The server has an API key, so that its
/metrics answers only Prometheus' bearer token from that file (as in compose). After a few generations that the
n-gram draft partly predicts, the dashboard's acceptance-rate query, asked of Prometheus, equals accepted /
drafted read from /metrics directly, and every other query of the dashboard returns data. vLLM's example
dashboard (its queries: tests/data/vllm_dashboard_queries.json) reads this server too, once its prefix ``vllm:``
is ``specserve_``. Under CI a missing binary fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _server import free_port, running_server
from prometheus_client.parser import text_string_to_metric_families

from app.engine.step import StepOutput
from app.service.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "specserve.json").read_text())
VLLM_DASHBOARD = json.loads((ROOT / "tests" / "data" / "vllm_dashboard_queries.json").read_text())
ACCEPTED = "specserve_spec_decode_num_accepted_tokens_total"
DRAFTED = "specserve_spec_decode_num_draft_tokens_total"
KEY = "prometheus-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI (Debian package prometheus)")
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    return binary


def metric(url: str, name: str, **labels: str) -> float:
    """The value of the one sample of the server's /metrics (read with the key) named `name` whose labels include
    `labels`; 0 when there is none."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else 0.0


def _scrape_config(target: str, key_file: Path) -> dict:
    """Our configuration, scraping `target` every second instead of the compose containers every 5 s, with the
    bearer token in `key_file` instead of the container's."""
    config = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "specserve"]
    del job["dns_sd_configs"]
    job["authorization"]["credentials_file"] = str(key_file)
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, target_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(specserve URL, Prometheus URL, specserve's log): a fresh server, and Prometheus scraping it."""
    binary = _prometheus()
    tmp = tmp_path_factory.mktemp("prometheus")
    log = tmp / "specserve.log"
    env = {**os.environ, "SPECSERVE_API_KEY": KEY}
    with running_server(log, "--dtype", "float32", "--log-format", "json", "--log-level", "info", env=env) as server:
        key_file = tmp / "specserve-api-key"
        key_file.write_text(KEY)
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(_scrape_config(server.removeprefix("http://"), key_file)))
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


def _wait_for(prom: str, expr: str, want: float, what: str, at_least: bool = False) -> None:
    """Until `expr`'s value is `want` (`at_least`: >= want), 15 s at most."""
    deadline = time.monotonic() + 15
    while not ((_value(prom, expr) or 0) >= want if at_least else _value(prom, expr) == want):
        assert time.monotonic() < deadline, f"Prometheus did not see {what}: {_value(prom, expr)} != {want}"
        time.sleep(0.2)


def _dashboard_expr(expr: str) -> str:
    """A dashboard query as Grafana sends it with every replica selected."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "1m")


def test_prometheus_reads_the_acceptance_rate(stack: tuple[str, str, Path]) -> None:
    server, prom, log = stack
    # /metrics needs the key: Prometheus scrapes with the one in its credentials file.
    assert httpx.get(f"{server}/metrics").status_code == 401
    # A first scrape of the fresh server (counters at 0) before anything is generated.
    _wait_for(prom, 'up{job="specserve"}', 1.0, "the server up")
    _wait_for(prom, DRAFTED, 0.0, "the counters")

    repeat = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the quiet river bank."
    requests = [
        ("/generate", {"inputs": "a b c d a b c d a b c d a b", "parameters": {"max_new_tokens": 16}}),
        (
            "/v1/chat/completions",
            {"max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": repeat}]},
        ),
        ("/generate", {"inputs": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "parameters": {"max_new_tokens": 16}}),
    ]
    for i, (path, body) in enumerate(requests):
        r = httpx.post(f"{server}{path}", json=body, headers={**AUTH, "X-Request-ID": f"prom-test-{i}"}, timeout=120)
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


def _vllm_expr(expr: str, model: str) -> str:
    """A query of vLLM's dashboard with our prefix, as Grafana sends it with `model` selected."""
    expr = expr.replace("vllm:", "specserve_").replace("$model_name", model)
    return expr.replace("$__rate_interval", "1m")


def test_vllms_dashboard_reads_specserve(stack: tuple[str, str, Path]) -> None:
    server, prom, _ = stack
    info = httpx.get(f"{server}/info", headers=AUTH).json()
    model, k = info["served_model_name"], info["num_draft_tokens"]
    requests = [
        ("/generate", {"inputs": "a b c d a b c d a b c d a b", "parameters": {"max_new_tokens": 6}}),
        ("/v1/completions", {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 5, "temperature": 0}),
    ]
    for path, body in requests:
        assert httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=120).status_code == 200
    samples = [
        sample
        for family in text_string_to_metric_families(httpx.get(f"{server}/metrics", headers=AUTH).text)
        for sample in family.samples
    ]
    assert samples and all(s.labels.get("model_name") == model for s in samples)

    # Every metric the dashboard reads is served, with the label it selects on.
    names = {s.name for s in samples}
    exprs = [_vllm_expr(e, model) for panel in VLLM_DASHBOARD["panels"] for e in panel["exprs"]]
    wanted = {name for e in exprs for name in re.findall(r"specserve_\w+", e)}
    assert len(wanted) == 21 and wanted <= names, sorted(wanted - names)

    def value(name: str, **labels: str) -> float:
        return metric(server, name, **labels)

    # The request-level series count what happened: every request so far (this module's too) succeeded.
    ended = value("specserve_e2e_request_latency_seconds_count")
    assert ended >= len(requests)
    success = {r: value("specserve_request_success_total", finished_reason=r) for r in ("stop", "length", "abort")}
    assert success["abort"] == 0 and success["stop"] + success["length"] == ended
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds"):
        assert value(f"specserve_{name}_count") == ended, name
    generated = value("specserve_request_generation_tokens_sum")
    assert (
        generated
        == value("specserve_generation_tokens_total")
        == value("specserve_request_max_num_generation_tokens_sum")
    )
    assert value("specserve_request_prompt_tokens_sum") == value("specserve_prompt_tokens_total")
    assert value("specserve_time_per_output_token_seconds_count") == generated - ended  # all but each first token
    assert value("specserve_kv_cache_usage_perc") == value("specserve_gpu_cache_usage_perc") == 0.0  # idle
    # The draft's positions exist from the start; acceptance at a position is accepted / drafted there.
    for position in range(k):
        drafted = value("specserve_spec_decode_num_draft_tokens_per_pos_total", position=str(position))
        accepted = value("specserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
        assert 0 <= accepted <= drafted <= value("specserve_spec_decode_num_drafts_total")

    # Grafana's model_name variable finds the served name; every query of the dashboard returns data.
    _wait_for(prom, 'sum(specserve_request_success_total{finished_reason=~"stop|length"})', ended, "the requests")
    # rate() over a window needs two samples of a series: where Prometheus' first scrape came after every request
    # had ended (a quick run), the latency rates had one and answered nothing until the next scrape.
    samples = "min(count_over_time(specserve_e2e_request_latency_seconds_count[1m]))"
    _wait_for(prom, samples, 2, "two scrapes of the server", at_least=True)
    variable = VLLM_DASHBOARD["variables"]["model_name"]
    assert variable == 'label_values({__name__=~"vllm:.*"},model_name)'
    found = httpx.get(f"{prom}/api/v1/label/model_name/values", params={"match[]": '{__name__=~"specserve_.*"}'})
    assert found.json()["data"] == [model]
    for expr in exprs:
        assert _query(prom, expr), f"no data for {expr}"


def test_acceptance_by_position_counts_the_positions_drafted() -> None:
    metrics = Metrics("m")
    metrics.engine_started("torch", "float32", batched_decoding=False, num_draft_tokens=3)

    def per_position(which: str) -> list[float | None]:
        name = f"specserve_spec_decode_num_{which}_tokens_per_pos_total"
        return [metrics.registry.get_sample_value(name, {"model_name": "m", "position": str(p)}) for p in range(5)]

    assert per_position("draft") == per_position("accepted") == [0.0, 0.0, 0.0, None, None]
    # An adaptive draft: 3 tokens (2 accepted), then 1 (accepted), then 5 (a request's longer k; 4 accepted).
    for drafted, accepted in ((3, 2), (1, 1), (5, 4)):
        out = StepOutput([7] * (accepted + 1), "", drafted, accepted, 0.01, 0.02)
        metrics.step(out, accepted + 1, prefill=False)
    assert per_position("draft") == [3.0, 2.0, 2.0, 1.0, 1.0]
    assert per_position("accepted") == [3.0, 2.0, 1.0, 1.0, None]
    assert metrics.registry.get_sample_value("specserve_spec_decode_num_drafts_total", {"model_name": "m"}) == 3


def test_docker_ci_checks_pass_on_a_real_stack(stack: tuple[str, str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """docker/ci/checks.py (what `make docker-test` asks of the containers) holds for a server and Prometheus
    run without Docker, so that a failure there is the containers', not the checks'. (The stack's server has a
    key, which the checks send as compose's SPECSERVE_API_KEY.)"""
    import importlib.util

    server, prom, _ = stack
    monkeypatch.setenv("SPECSERVE_API_KEY", KEY)
    spec = importlib.util.spec_from_file_location("docker_ci_checks", ROOT / "docker" / "ci" / "checks.py")
    assert spec is not None and spec.loader is not None
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    assert checks.main(["server", server]) == 0
    assert checks.main(["prometheus", prom, server]) == 0
