"""The deployment files, checked without a Docker engine: compose, Dockerfile, Prometheus, Grafana, nginx, k8s.

Each file names things other files define (services, ports, paths in the image, metric names, settings);
these tests check that every such name resolves: the compose file against the repository and the Dockerfile,
the Prometheus and nginx targets against the compose services, the Grafana provisioning against the mounts,
every PromQL expression of the dashboard and the autoscaler's metric against what a running specserve
exports, every SPECSERVE_* variable against the settings. `promtool check config` checks the Prometheus
configuration (it fails rather than skips under CI, which installs it). tests/test_prometheus.py runs the
real Prometheus on it.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from app.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
DASHBOARD_FILE = DOCKER / "grafana" / "dashboards" / "specserve.json"
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())
NGINX = (DOCKER / "nginx" / "nginx.conf").read_text()
SPECSERVE_SERVICES = ("specserve", "specserve-replica")
SPECSERVE_VARIABLES = {"SPECSERVE_" + name.upper() for name in Settings.model_fields} | {"SPECSERVE_CACHE"}
# A prompt the n-gram draft predicts well, so that every speculative series (per position too) has samples.
REPETITIVE = "a b c d a b c d a b c d a b"


def interpolate(value: str) -> str:
    """A compose value with every ${VAR:-default} replaced by its default (as with nothing set)."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def published(service: str) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each port a service publishes."""
    out = []
    for spec in SERVICES[service].get("ports", []):
        address, host, container = interpolate(spec).rsplit(":", 2)
        out.append((address, int(host), int(container)))
    return out


def mounts(service: str) -> list[tuple[str, str]]:
    """(source, target) of each volume of a service: a named volume or a ./path of the repository."""
    out = []
    for spec in SERVICES[service].get("volumes", []):
        source, target, *_ = spec.split(":")
        out.append((source, target))
    return out


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env() -> dict[str, str]:
    env = {}
    for word, rest in dockerfile():
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    return env


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docker_{name}", DOCKER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- docker-compose.yml ----------------------------------------------------------------------------------


def test_compose_services_and_profiles() -> None:
    assert set(SERVICES) == {"specserve", "prometheus", "grafana", "specserve-replica", "lb"}
    plain = {name for name, s in SERVICES.items() if not s.get("profiles")}
    assert plain == {"specserve", "prometheus"}  # what `docker compose up` starts: nothing that needs a password
    assert SERVICES["specserve-replica"]["profiles"] == ["scaled"] == SERVICES["lb"]["profiles"]
    assert SERVICES["grafana"]["profiles"] == ["dashboard"]
    assert SERVICES["specserve-replica"]["deploy"]["replicas"] >= 2
    for name, variable in (("prometheus", "PROMETHEUS_IMAGE"), ("grafana", "GRAFANA_IMAGE"), ("lb", "NGINX_IMAGE")):
        # A variable (a machine without Docker Hub names a local image), by default a pinned Docker Hub image.
        match = re.fullmatch(r"\$\{(\w+):-([^}]+)\}", SERVICES[name]["image"])
        assert match and match.group(1) == variable, SERVICES[name]["image"]
        image = match.group(2)
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    # Compose v1 (Debian's docker-compose 1.29) rejects a top-level `name:`.
    assert set(COMPOSE) == {"x-specserve", "services", "volumes"}


def test_compose_specserve_is_built_from_the_dockerfile() -> None:
    for name in SPECSERVE_SERVICES:
        service = SERVICES[name]
        build = service["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        assert interpolate(build["args"]["TORCH_VARIANT"]) == "cpu"
        args = dict(rest.split("=", 1) for word, rest in dockerfile() if word == "ARG")
        assert set(build["args"]) <= set(args)
        # Unset, compose builds what a plain `docker build` does: the slim Python image, torch from the index.
        base = args["BASE_IMAGE"].replace("${PYTHON_VERSION}", args["PYTHON_VERSION"])
        assert interpolate(build["args"]["BASE_IMAGE"]) == base == "python:3.12-slim"
        assert interpolate(build["args"]["TORCH_WHEEL"]) == args["TORCH_WHEEL"] == ""
        # The healthcheck runs the script where the Dockerfile puts it.
        assert service["healthcheck"]["test"] == ["CMD", "python", "/opt/specserve/docker/healthcheck.py"]
        assert "specserve-pool" in service["networks"]["default"]["aliases"]


def test_compose_environment_is_the_service_settings() -> None:
    for name in SPECSERVE_SERVICES:
        env = SERVICES[name]["environment"]
        assert set(env) <= SPECSERVE_VARIABLES, set(env) - SPECSERVE_VARIABLES
        # No model, draft or limit is chosen here: unset, the server's own defaults apply.
        for key in ("SPECSERVE_TARGET", "SPECSERVE_DRAFT", "SPECSERVE_API_KEY"):
            assert env[key] is None, key
        assert env["SPECSERVE_METRICS_PUBLIC"] is None  # unset: /metrics needs the key (Prometheus sends it)
    # The Dockerfile's defaults are settings too, and the server listens on every interface in the container.
    env = dockerfile_env()
    assert {k for k in env if k.startswith("SPECSERVE_")} <= SPECSERVE_VARIABLES
    assert env["SPECSERVE_HOST"] == "0.0.0.0"
    assert Settings().host == "127.0.0.1"  # outside a container: local only


def test_compose_ports() -> None:
    expected = {"specserve": 8000, "prometheus": 9090, "grafana": 3000, "lb": 8080}
    seen_host_ports = []
    for name, container_port in expected.items():
        [(address, host, container)] = published(name)
        assert address == "127.0.0.1", f"{name} is published beyond this host by default"
        assert container == container_port
        seen_host_ports.append(host)
    assert len(set(seen_host_ports)) == len(seen_host_ports)
    assert "ports" not in SERVICES["specserve-replica"]  # replicas are reached through the load balancer
    env = dockerfile_env()
    assert int(env["SPECSERVE_PORT"]) == expected["specserve"]
    assert ("EXPOSE", str(expected["specserve"])) in dockerfile()
    assert re.search(rf"^\s*listen {expected['lb']};", NGINX, re.M)


def test_compose_volumes_exist() -> None:
    declared = set(COMPOSE["volumes"])
    used = set()
    for name in SERVICES:
        for source, target in mounts(name):
            assert target.startswith("/"), (name, target)
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in declared, f"{name} uses the undeclared volume {source}"
                used.add(source)
    assert used == declared
    # The model cache volume is where the image keeps the cache, and what the image declares a volume.
    cache = dockerfile_env()["SPECSERVE_CACHE"]
    for name in SPECSERVE_SERVICES:
        assert ("model-cache", cache) in mounts(name)
    assert ("VOLUME", f'["{cache}"]') in dockerfile()


def test_compose_load_balancer_waits_for_healthy_servers() -> None:
    depends = SERVICES["lb"]["depends_on"]
    assert set(depends) == set(SPECSERVE_SERVICES)
    assert all(d["condition"] == "service_healthy" for d in depends.values())
    assert ("./docker/nginx/nginx.conf", "/etc/nginx/nginx.conf") in mounts("lb")


def test_gpu_override_names_the_same_services() -> None:
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yml").read_text())
    assert set(gpu["services"]) == set(SPECSERVE_SERVICES)
    for service in gpu["services"].values():
        assert interpolate(service["build"]["args"]["TORCH_VARIANT"]).startswith("cu")
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert set(service["environment"]) <= SPECSERVE_VARIABLES


# --- docker/Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile() -> None:
    steps = dockerfile()
    words = [w for w, _ in steps]
    run = " ".join(rest for w, rest in steps if w == "RUN")
    args = dict(rest.split("=", 1) for w, rest in steps if w == "ARG" and "=" in rest)
    # No `# syntax=` directive: BuildKit would fetch that frontend from Docker Hub.
    assert not re.search(r"^#\s*syntax\s*=", (DOCKER / "Dockerfile").read_text(), re.M | re.I)
    # One FROM, the base image a build argument (a local image where Docker Hub is out of reach).
    assert [rest for w, rest in steps if w == "FROM"] == ["${BASE_IMAGE}"]
    # torch from PyTorch's index, CPU build unless asked; the version the Makefile installs. Or a wheel of
    # that version from docker/wheels/ (a directory in the repository, so that the COPY never fails).
    assert args["TORCH_VARIANT"] == "cpu"
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"' in run
    assert ("COPY", "docker/wheels/ /tmp/wheels/") in steps and (DOCKER / "wheels").is_dir()
    assert 'pip install "/tmp/wheels/${TORCH_WHEEL}"' in run and '"torch-${TORCH_VERSION}"[+-]*)' in run
    makefile_pin = re.search(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert makefile_pin is not None and args["TORCH_VERSION"] == makefile_pin.group(1)
    # A C compiler for the CPU kernels (app/engine/kernels/), which the server compiles at first start.
    assert "apt-get install -y --no-install-recommends gcc libc6-dev" in run
    # Every COPY source is in the build context, and not ignored.
    ignored = [p for p in (ROOT / ".dockerignore").read_text().split() if not p.startswith("#")]
    for word, rest in steps:
        if word == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source.split("/")[0] not in ignored, source
    assert ".venv" in ignored and ".git" in ignored
    # Non-root from the user step on; health check and entry point are the scripts copied in.
    user = next(rest for w, rest in steps if w == "USER")
    assert user not in ("root", "0") and words.index("USER") > words.index("VOLUME")
    assert ("WORKDIR", "/opt/specserve") in steps
    healthcheck = next(rest for w, rest in steps if w == "HEALTHCHECK")
    assert healthcheck.endswith('CMD ["python", "/opt/specserve/docker/healthcheck.py"]')
    assert ("ENTRYPOINT", '["python", "/opt/specserve/docker/entrypoint.py"]') in steps


def test_entrypoint_fetches_what_the_server_will_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entrypoint = load_script("entrypoint")
    plan = entrypoint.models_to_fetch
    target = "smollm2-135m-instruct"
    assert plan([], {}) == [target]  # the default target; the default draft (n-gram) needs nothing
    assert plan(["--draft", "none"], {"SPECSERVE_DRAFT": target}) == [target]  # the flag wins
    assert plan([], {"SPECSERVE_DRAFT": target}) == [target]  # once
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    assert plan(["--target", str(model), "--port", "1"], {}) == []  # a path is loaded as it is
    assert plan([], {"SPECSERVE_TARGET": "no-such-model"}) == []  # the server says what is wrong


def test_healthcheck_fails_without_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from _server import free_port

    monkeypatch.setenv("SPECSERVE_PORT", str(free_port()))
    assert load_script("healthcheck").main() == 1


# --- Prometheus ------------------------------------------------------------------------------------------


def test_prometheus_scrapes_every_specserve_container() -> None:
    assert PROMETHEUS["global"]["scrape_interval"] == "5s"
    [job] = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "specserve"]
    assert job["metrics_path"] == "/metrics"
    [sd] = job["dns_sd_configs"]
    aliases = {a for s in SPECSERVE_SERVICES for a in SERVICES[s]["networks"]["default"]["aliases"]}
    assert set(sd["names"]) <= aliases | set(SERVICES)
    assert sd["port"] == int(dockerfile_env()["SPECSERVE_PORT"])
    assert ("./docker/prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml") in mounts("prometheus")
    assert "--config.file=/etc/prometheus/prometheus.yml" in SERVICES["prometheus"]["command"]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI (Debian package prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return promtool


def _promtool_check(config: dict, tmp_path: Path) -> None:
    """`promtool check config` accepts `config`, each job's credentials file made an (empty) file of the test's:
    promtool checks that it exists, and the real one is in the container (or the pod)."""
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(tmp_path / f"{job['job_name']}-key")
            Path(job["authorization"]["credentials_file"]).write_text("")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout


def test_promtool_checks_the_prometheus_config(tmp_path: Path) -> None:
    file = DOCKER / "prometheus" / "prometheus.yml"
    check = subprocess.run([_promtool(), "check", "config", "--syntax-only", str(file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    _promtool_check(yaml.safe_load(file.read_text()), tmp_path)


def _entrypoint(service: str, replace: dict[str, str]) -> list[str]:
    """A compose service's entry point as its container runs it (compose turns `$$` into `$`), with the paths of
    its image in `replace` replaced by the test's."""
    argv = [part.replace("$$", "$") for part in SERVICES[service]["entrypoint"]]
    for old, new in replace.items():
        argv = [part.replace(old, new) for part in argv]
    assert argv[:2] == ["/bin/sh", "-c"]  # both Prometheus images (and Grafana's) have a shell there
    return argv


def test_prometheus_sends_the_api_key_compose_gives_it(tmp_path: Path) -> None:
    """/metrics needs the key once the servers have one: compose passes SPECSERVE_API_KEY on to Prometheus, whose
    entry point (run here with a stand-in prometheus, the data volume a directory of the test's) writes it, to be
    read by Prometheus' user alone, where the specserve job takes its bearer token, then runs prometheus with
    compose's flags; without a key the file is empty (a keyless server reads no header)."""
    [job] = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "specserve"]
    assert job["authorization"]["type"] == "Bearer"
    key_file = Path(job["authorization"]["credentials_file"])
    service = SERVICES["prometheus"]
    assert "SPECSERVE_API_KEY" in service["environment"] and service["environment"]["SPECSERVE_API_KEY"] is None
    # The data volume: what Prometheus' user may write in prom/prometheus and in the Debian stand-in.
    assert ("prometheus-data", str(key_file.parent)) in mounts("prometheus")
    data, bin_dir = tmp_path / "data", tmp_path / "bin"
    data.mkdir()
    bin_dir.mkdir()
    (bin_dir / "prometheus").write_text('#!/bin/sh\nprintf "%s\\n" "$@" >"$ARGS_FILE"\n')
    (bin_dir / "prometheus").chmod(0o755)
    argv = _entrypoint("prometheus", {f"{key_file.parent}/": f"{data}/"})
    for key in ("a-key-0123456789", None):
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGS_FILE": str(tmp_path / "args")}
        if key is not None:
            env["SPECSERVE_API_KEY"] = key
        done = subprocess.run([*argv, *service["command"]], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        written = data / key_file.name
        assert written.read_text() == (key or "") and (written.stat().st_mode & 0o777) == 0o600
        assert (tmp_path / "args").read_text().split("\n")[:-1] == service["command"]
    # Published on this host alone whatever BIND_ADDRESS says: it answers anyone with every series it scraped.
    [port] = service["ports"]
    assert port.startswith("${PROMETHEUS_BIND_ADDRESS:-127.0.0.1}:"), port


def test_metrics_need_the_key_in_compose_and_k8s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither compose nor the k8s Deployment serves /metrics without the key: the setting is left to the
    server's default, under which /metrics is no open path of a keyed server."""
    from app.api.server import open_paths

    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    for name in SPECSERVE_SERVICES:
        assert SERVICES[name]["environment"]["SPECSERVE_METRICS_PUBLIC"] is None, name
    [container] = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "SPECSERVE_METRICS_PUBLIC" not in {e["name"] for e in container["env"]}
    monkeypatch.setenv("SPECSERVE_API_KEY", "a-key-0123456789")
    assert "/metrics" not in open_paths(Settings()) and "/health" in open_paths(Settings())


# --- Grafana ---------------------------------------------------------------------------------------------


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    grafana = dict(mounts("grafana"))
    provisioning = DOCKER / "grafana" / "provisioning"
    assert grafana["./docker/grafana/provisioning"] == "/etc/grafana/provisioning"
    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    [(_, _, prometheus_port)] = published("prometheus")
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "specserve.yml").read_text())["providers"]
    dashboards_dir = grafana["./docker/grafana/dashboards"]
    assert provider["options"]["path"] == dashboards_dir
    # The dashboard is the home page (after the login: test_grafana_needs_its_own_password).
    env = SERVICES["grafana"]["environment"]
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dashboards_dir}/{DASHBOARD_FILE.name}"
    # Every panel and query uses the provisioned data source.
    uids = {p["datasource"]["uid"] for p in DASHBOARD["panels"]}
    uids |= {t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p["targets"]}
    uids |= {v["datasource"]["uid"] for v in DASHBOARD["templating"]["list"]}
    assert uids == {datasource["uid"]}


def test_grafana_needs_its_own_password(tmp_path: Path) -> None:
    """No admin/admin, no anonymous viewer (who may query Prometheus through it): Grafana's entry point (run here
    with a stand-in for its image's /run.sh) refuses to start without GRAFANA_ADMIN_PASSWORD or with "admin",
    and starts Grafana with its arguments given one."""
    service = SERVICES["grafana"]
    env = service["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:-\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    assert interpolate(env["GF_SECURITY_ADMIN_PASSWORD"]) == ""  # nothing set: empty, refused below
    run = tmp_path / "run.sh"
    run.write_text('#!/bin/sh\necho "grafana started: $*"\n')
    run.chmod(0o755)
    argv = _entrypoint("grafana", {"/run.sh": str(run)})
    for password, starts in (("", False), ("admin", False), ("a-password-of-its-own", True)):
        env = {"PATH": "/usr/bin:/bin", "GF_SECURITY_ADMIN_PASSWORD": password}
        done = subprocess.run([*argv, "cfg:x"], env=env, capture_output=True, text=True, timeout=30)
        if starts:
            assert done.returncode == 0 and done.stdout == "grafana started: cfg:x\n", done
        else:
            assert done.returncode != 0 and "set GRAFANA_ADMIN_PASSWORD" in done.stderr and not done.stdout, done


def test_dashboard_has_the_promised_panels() -> None:
    titles = [p["title"] for p in DASHBOARD["panels"]]
    for title in (
        "Acceptance rate",
        "Tokens per target pass",
        "Acceptance rate by position",
        "Tokens/s",
        "Time to first token",
        "Inter-token latency",
        "Requests by outcome",
        "In flight and queued",
        "Finish reason",
        "KV cache usage",
        "Prompt and generation length",
    ):
        assert title in titles
    assert len(set(titles)) == len(titles)
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(titles)
    assert DASHBOARD["refresh"] == "5s"
    for name in ("Time to first token", "Inter-token latency"):
        [panel] = [p for p in DASHBOARD["panels"] if p["title"] == name]
        quantiles = sorted(re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1) for t in panel["targets"])
        assert quantiles == ["0.5", "0.9", "0.99"]
    # Panels do not overlap on the 24-column grid.
    cells = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, p["title"]
        cells |= area


PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "group_left",
    "group_right", "and", "or", "unless", "bool", "offset", "max_over_time", "avg_over_time", "clamp_min",
    "label_values", "topk", "bottomk",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values query) reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings, such as label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", "", expr)  # numbers
    expr = re.sub(r",\s*\w+\s*\)", ")", expr) if expr.startswith("label_values") else expr  # its label
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)) - PROMQL_WORDS
    return names


def dashboard_queries() -> list[str]:
    queries = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in DASHBOARD["templating"]["list"]]
    return queries


def test_promql_metric_extraction() -> None:
    expr = (
        'sum by (position) (rate(a_total{instance=~"$x", b="c d"}[$__rate_interval]))\n'
        "  / ignoring(position) group_left sum(rate(b_total[5m])) * 0.5"
    )
    assert promql_metrics(expr) == {"a_total", "b_total"}
    assert promql_metrics("histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))") == {"h_bucket"}
    assert promql_metrics("label_values(g, instance)") == {"g"}


@pytest.fixture(scope="module")
def exported(api_client) -> set[str]:
    """The sample names (`x_total`, `x_bucket`, ...) a running specserve's /metrics has after a request."""
    import anyio

    async def scrape() -> str:
        async with api_client() as client:
            body = {"inputs": REPETITIVE, "parameters": {"max_new_tokens": 8}}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200
            return (await client.get("/metrics")).text

    text = anyio.run(scrape)
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_dashboard_queries_read_only_exported_metrics(exported: set[str]) -> None:
    assert "specserve_spec_decode_num_accepted_tokens_per_pos_total" in exported  # the request accepted drafts
    for query in dashboard_queries():
        names = promql_metrics(query)
        assert names, query
        assert names <= exported, f"{sorted(names - exported)} in {query!r} are not exported"
        # Quantiles come from histogram buckets, summed by le.
        if "histogram_quantile" in query:
            assert all(n.endswith("_bucket") for n in names) and "by (le)" in query, query


# --- nginx (the scaled profile) ----------------------------------------------------------------------------


def nginx_directives(directive: str, text: str = NGINX) -> list[str]:
    """The arguments of every `directive` in an nginx configuration, in order."""
    return [m.strip() for m in re.findall(rf"^\s*{directive}\s+([^;]*);", text, re.M)]


def test_nginx_routes_each_tenant_to_one_replica_of_those_lb_sh_finds() -> None:
    # One upstream, its servers written by lb.sh (one per address of the alias: nginx hashes a server line's
    # name, so the alias itself would be round robin among its addresses), hashed by the tenant's key.
    assert nginx_directives("proxy_pass") == ["http://specserve"]
    upstream = NGINX[NGINX.index("upstream specserve {") :]
    upstream = upstream[: upstream.index("}")]
    assert nginx_directives("include", upstream) == ["specserve-pool.conf"]
    lb = SERVICES["lb"]
    assert lb["entrypoint"] == ["/bin/sh", "/etc/nginx/lb.sh"]
    assert ("./docker/nginx/lb.sh", "/etc/nginx/lb.sh") in mounts("lb")
    assert interpolate(lb["environment"]["LB_BALANCE"]) == "affinity"
    script = (DOCKER / "nginx" / "lb.sh").read_text()
    pool = re.search(r"^POOL=\$\{LB_POOL:-(\S+)\}$", script, re.M)
    port = re.search(r"^PORT=\$\{LB_POOL_PORT:-(\d+)\}$", script, re.M)
    aliases = {a for s in SPECSERVE_SERVICES for a in SERVICES[s]["networks"]["default"]["aliases"]}
    assert pool and pool.group(1) in aliases  # every specserve container, not one service
    assert port and int(port.group(1)) == int(dockerfile_env()["SPECSERVE_PORT"])
    assert "hash $specserve_affinity consistent;" in script
    # The key: the API key, then the client's affinity header or else the body's cache_salt and prompt.
    key = re.search(r"map \$http_x_specserve_affinity \$specserve_affinity \{(.*?)\}", NGINX, re.S)
    assert key is not None
    body_key, header_key = re.findall(r'^\s*(?:""|default)\s+"([^"]*)";', key.group(1), re.M)
    assert body_key.split("|") == [
        "$http_authorization",
        "$specserve_salt",
        "$specserve_prompt_head",
        "$specserve_first_user",
    ]
    assert header_key.split("|") == ["$http_authorization", "$http_x_specserve_affinity"]
    # $request_body is set only for a body held in memory: the buffer holds any body nginx accepts.
    assert nginx_directives("client_body_buffer_size") == nginx_directives("client_max_body_size")
    assert re.search(r"^\s*proxy_buffering off;", NGINX, re.M)  # server-sent events token by token
    assert "proxy_set_header X-Request-ID" in NGINX
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert "X-Specserve-Affinity" in deploy and "LB_BALANCE=round-robin" in deploy


def test_nginx_fails_over_fast_and_spills_full_replicas() -> None:
    [next_upstream] = nginx_directives("proxy_next_upstream")
    assert set(next_upstream.split()) == {"error", "timeout", "http_429", "http_503", "non_idempotent"}
    [connect] = nginx_directives("proxy_connect_timeout")
    assert connect.endswith("s") and int(connect[:-1]) <= 2  # a gone replica's address may not refuse
    # No failure takes a server out: with every replica full nginx would answer 502 instead of their 429s.
    script = (DOCKER / "nginx" / "lb.sh").read_text()
    assert re.findall(r'echo "server \$address:\$PORT ([^;"]*);"', script) == ["max_fails=0"]


def _nginx() -> str:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is missing in CI (Debian package nginx)")
        pytest.skip("nginx not installed (apt-get install nginx)")
    return nginx


class _Replica:
    """A stand-in specserve on (host, port): answers every POST with its name, as the body."""

    def __init__(self, name: str, host: str, port: int) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Balancer:
    """docker/nginx/lb.sh running the real nginx on our nginx.conf (its port and file paths the test's) over
    stand-in replicas A and B (C runs too, outside the pool unless a stand-in getent adds it), one per loopback
    address, all on one port."""

    def __init__(self, tmp_path: Path, balance: str = "affinity", getent: str | None = None) -> None:
        nginx = _nginx()
        self.replicas: dict[str, _Replica] = {}
        for _ in range(20):  # a port free on both addresses
            probe = socket.socket()
            probe.bind(("127.0.0.2", 0))
            port = probe.getsockname()[1]
            probe.close()
            try:
                self.replicas = {name: _Replica(name, f"127.0.0.{i + 2}", port) for i, name in enumerate("ABC")}
                break
            except OSError:
                for replica in self.replicas.values():
                    replica.kill()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        conf = NGINX
        for old, new in (
            ("listen 8080;", f"listen 127.0.0.1:{self.url.rsplit(':', 1)[1]};"),
            ("worker_processes auto;", f"worker_processes 2;\npid {tmp_path}/nginx.pid;"),
            ("http {", "http {\n" + "".join(f"{t}_temp_path {tmp_path}/{t};\n" for t in _NGINX_TEMP)),
        ):
            assert conf.count(old) == 1, old
            conf = conf.replace(old, new)
        (tmp_path / "nginx.conf").write_text(conf)
        self.servers = tmp_path / "specserve-pool.conf"
        env = {
            **os.environ,
            "LB_POOL": "127.0.0.2 127.0.0.3",
            "LB_POOL_PORT": str(port),
            "LB_BALANCE": balance,
            "LB_RESOLVE_SECONDS": "0.2",
            "NGINX_CONF": str(tmp_path / "nginx.conf"),
            "PATH": f"{Path(nginx).parent}:{os.environ.get('PATH', '')}",
        }
        if getent is not None:  # a stand-in getent, first on PATH, answers the look-ups
            (tmp_path / "bin").mkdir()
            (tmp_path / "bin" / "getent").write_text(f"#!/bin/sh\n{getent}\n")
            (tmp_path / "bin" / "getent").chmod(0o755)
            env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
            env["LB_POOL"] = "specserve-pool"
        self.log = tmp_path / "access.log"
        self.process = subprocess.Popen(
            ["sh", str(DOCKER / "nginx" / "lb.sh"), "-e", "stderr"],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _wait_for(lambda: self._healthy(), 10, "nginx answering")

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"nginx exited: {self.process.stderr.read()}")  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(f"{self.url}/lb-health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def ask(self, body: dict, headers: dict[str, str] | None = None, path: str = "/generate") -> str:
        """The replica that answered a POST (within 5 s, failover included)."""
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode()

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGQUIT)  # nginx's graceful stop; lb.sh's loop ends with it
        self.process.wait(10)
        for replica in self.replicas.values():
            replica.kill()


_NGINX_TEMP = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def _wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.05)


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[_Balancer]:
    lb = _Balancer(tmp_path)
    yield lb
    lb.stop()


def _chat(salt: str | None, turn: int, user: str = "Tell me about the sea.") -> dict:
    """A chat's turn as the OpenAI SDK sends it: messages first, the conversation growing, max_tokens changing."""
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}, {"role": "user", "content": user}]
    for t in range(turn):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"and {t}?"}]
    body = {"messages": messages, "model": "specserve", "max_tokens": 16 + turn, "stream": turn % 2 == 0}
    return body | ({"cache_salt": salt} if salt else {})


def test_nginx_keeps_a_tenant_on_one_replica_and_spreads_tenants(balancer: _Balancer) -> None:
    """The real nginx on our configuration: each tenant's 20 requests on one replica, whatever else changes
    between them (the conversation's growth, max_tokens, the route), and the tenants over both replicas."""
    salted = {
        i: {balancer.ask(_chat(f"tenant-{i:02d}-0123456789", t), path="/v1/chat/completions") for t in range(20)}
        for i in range(12)
    }
    assert all(len(where) == 1 for where in salted.values()), salted
    assert {r for where in salted.values() for r in where} == {"A", "B"}
    # Unsalted, under one API key: conversations (their first user message) spread, each on one replica.
    key = {"Authorization": "Bearer one-key-for-everyone"}
    chats = {
        i: {balancer.ask(_chat(None, t, f"conversation {i}"), key, "/v1/chat/completions") for t in range(20)}
        for i in range(12)
    }
    assert all(len(where) == 1 for where in chats.values()), chats
    assert {r for where in chats.values() for r in where} == {"A", "B"}
    # The native API, the salt in parameters, a conversation's inputs growing; a client's own key (a session id)
    # in X-Specserve-Affinity, whatever its prompts.
    native = {
        i: {
            balancer.ask(
                {
                    "inputs": "System: you are a helpful assistant; answer briefly and well.\nUser: hi" + " more" * t,
                    "parameters": {"cache_salt": f"native-{i:02d}-0123456789"},
                }
            )
            for t in range(20)
        }
        for i in range(12)
    }
    assert all(len(where) == 1 for where in native.values()), native
    sessions = {
        i: {balancer.ask({"inputs": f"turn {t}"}, {"X-Specserve-Affinity": f"session-{i}"}) for t in range(20)}
        for i in range(12)
    }
    assert all(len(where) == 1 for where in sessions.values()), sessions
    assert {r for where in sessions.values() for r in where} == {"A", "B"}


def test_nginx_round_robin_spreads_one_tenant(tmp_path: Path) -> None:
    """LB_BALANCE=round-robin (the comparison of docs/deploy.md): one tenant's requests on both replicas."""
    lb = _Balancer(tmp_path, "round-robin")
    try:
        assert {lb.ask(_chat("tenant-00-0123456789", 0), path="/v1/chat/completions") for _ in range(8)} == {"A", "B"}
    finally:
        lb.stop()


def test_nginx_serves_a_killed_replicas_tenants_from_another(balancer: _Balancer) -> None:
    """A replica killed: the next request of each of its tenants is answered by the other replica (within the
    5 s each request is given), and the other replica's tenants stay where they were."""
    owner = {i: balancer.ask(_chat(f"tenant-{i:02d}-0123456789", 0), path="/v1/chat/completions") for i in range(12)}
    assert set(owner.values()) == {"A", "B"}
    balancer.replicas["B"].kill()
    after = {i: balancer.ask(_chat(f"tenant-{i:02d}-0123456789", 1), path="/v1/chat/completions") for i in range(12)}
    assert after == dict.fromkeys(owner, "A")


def test_lb_sh_follows_the_pool_and_moves_only_the_changed_share(tmp_path: Path) -> None:
    """lb.sh looks the alias up again (here a stand-in getent, as glibc's ahostsv4 prints) and reloads nginx when
    the addresses change: a replica that joins gets tenants, and each tenant it does not get stays where it was."""
    answer = tmp_path / "pool.txt"
    answer.write_text("127.0.0.3       STREAM specserve-pool\n127.0.0.3       DGRAM\n127.0.0.2       STREAM\n")
    lb = _Balancer(tmp_path, getent=f'[ "$1" = ahostsv4 ] && [ "$2" = specserve-pool ] && cat {answer}')
    try:
        assert "127.0.0.4" not in lb.servers.read_text()

        def where() -> dict[int, str]:
            return {i: lb.ask({"inputs": "x", "cache_salt": f"tenant-{i:02d}-0123456789"}) for i in range(24)}

        before = where()
        assert set(before.values()) == {"A", "B"}
        answer.write_text(answer.read_text() + "127.0.0.4       STREAM\n")
        _wait_for(lambda: "127.0.0.4" in lb.servers.read_text(), 10, "lb.sh rewriting the servers")
        # The reload's new workers answer once the old ones have stopped taking connections: two rounds alike.
        rounds = [where()]

        def settled() -> bool:
            rounds.append(where())
            return "C" in rounds[-1].values() and rounds[-1] == rounds[-2]

        _wait_for(settled, 10, "nginx reloaded")
        after = rounds[-1]
        assert all(after[i] in (before[i], "C") for i in before), (before, after)
    finally:
        lb.stop()


def test_lb_sh_reads_busybox_nslookup_where_getent_has_no_ahostsv4(tmp_path: Path) -> None:
    """Alpine's nginx image: musl's getent has no ahostsv4, busybox's nslookup answers (its server's address
    first, which is not the pool's); lb.sh writes a server per answer and hands nginx its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in {
        "getent": "exit 1",
        "nslookup": "printf 'Server:\\t\\t127.0.0.11\\nAddress:\\t127.0.0.11:53\\n\\nNon-authoritative answer:\\n"
        "Name:\\tspecserve-pool\\nAddress: 172.18.0.5\\nName:\\tspecserve-pool\\nAddress: 172.18.0.3\\n'",
        "nginx": f'echo "$@" >{tmp_path}/nginx-args',
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NGINX_CONF": str(tmp_path / "nginx.conf")}
    subprocess.run(["sh", str(DOCKER / "nginx" / "lb.sh"), "-e", "stderr"], env=env, check=True, timeout=10)
    servers = (tmp_path / "specserve-pool.conf").read_text()
    assert re.findall(r"^server (\S+) ", servers, re.M) == ["172.18.0.3:8000", "172.18.0.5:8000"]
    assert "hash $specserve_affinity consistent;" in servers
    assert (tmp_path / "nginx-args").read_text().split() == [
        "-c",
        str(tmp_path / "nginx.conf"),
        "-e",
        "stderr",
        "-g",
        "daemon",
        "off;",
    ]
    bad = subprocess.run(
        ["sh", str(DOCKER / "nginx" / "lb.sh")], env={**env, "LB_BALANCE": "random"}, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "LB_BALANCE must be" in bad.stderr


def test_nginx_bounds_slow_clients_and_connections_per_client() -> None:
    # What docs/deploy.md recommends for an exposed server: uvicorn has no timeout for a request's headers.
    server = NGINX[NGINX.index("server {") :]
    for directive in ("client_header_timeout", "client_body_timeout", "keepalive_timeout"):
        [value] = re.findall(rf"^\s*{directive}\s+(\d+)s;", server, re.M)
        assert int(value) <= 15, directive
    [zone] = re.findall(r"^\s*limit_conn_zone\s+\$binary_remote_addr\s+zone=(\w+):\d+m;", NGINX, re.M)
    assert re.search(rf"^\s*limit_conn\s+{zone}\s+\d+;", server, re.M)
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert "client_header_timeout 10s" in deploy and "limit_conn perip 32" in deploy


# --- Kubernetes --------------------------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict]:
    kustomization = yaml.safe_load((DOCKER / "k8s" / "kustomization.yaml").read_text())
    objects = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((DOCKER / "k8s" / name).read_text()):
            objects[doc["kind"]] = doc
    return objects


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DOCKER / "k8s" / "kustomization.yaml").read_text())
    manifests = {p.name for p in (DOCKER / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests - {"prometheus-adapter-values.yaml", "prometheus-values.yaml"}
    assert set(k8s_objects()) == {"Deployment", "Service", "HorizontalPodAutoscaler"}


def test_k8s_deployment_and_service() -> None:
    objects = k8s_objects()
    deployment, service = objects["Deployment"], objects["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(dockerfile_env()["SPECSERVE_PORT"])}
    [service_port] = service["spec"]["ports"]
    assert service_port["targetPort"] in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {e["name"] for e in container["env"]} <= SPECSERVE_VARIABLES
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] != 0
    cache = dockerfile_env()["SPECSERVE_CACHE"]
    assert cache in {m["mountPath"] for m in container["volumeMounts"]}
    # No job by annotation (it would scrape without the key): prometheus-values.yaml's finds the pods.
    assert "annotations" not in deployment["spec"]["template"]["metadata"]


def test_the_deployments_fail_closed_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image listens on every interface, which the server refuses without a key: the image alone needs a key
    (or the explicit flag), compose gives the flag only because it publishes on 127.0.0.1 of the host, and a k8s
    pod does not start without its key's secret."""
    from pydantic import ValidationError

    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    image = {k: v for k, v in dockerfile_env().items() if k.startswith("SPECSERVE_") and k != "SPECSERVE_CACHE"}
    for name, value in image.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match="no API key is set"):
        Settings()
    monkeypatch.setenv("SPECSERVE_API_KEY", "a-key-0123456789")
    assert Settings().host == "0.0.0.0"
    monkeypatch.delenv("SPECSERVE_API_KEY")
    for name in SPECSERVE_SERVICES:
        env = SERVICES[name]["environment"]
        monkeypatch.setenv("SPECSERVE_ALLOW_UNAUTHENTICATED", interpolate(env["SPECSERVE_ALLOW_UNAUTHENTICATED"]))
        assert Settings().allow_unauthenticated, name
    for name in ("specserve", "lb"):
        [(address, _, _)] = published(name)
        assert address == "127.0.0.1"
    [container] = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    [key] = [e for e in container["env"] if e["name"] == "SPECSERVE_API_KEY"]
    assert not key["valueFrom"]["secretKeyRef"].get("optional", False)
    assert "SPECSERVE_ALLOW_UNAUTHENTICATED" not in {e["name"] for e in container["env"]}


def _k8s_prometheus_job() -> tuple[dict, dict]:
    """(the specserve job, the chart's values) of prometheus-values.yaml."""
    values = yaml.safe_load((DOCKER / "k8s" / "prometheus-values.yaml").read_text())
    [job] = yaml.safe_load(values["extraScrapeConfigs"])
    return job, values


def test_k8s_prometheus_job_sends_the_key_of_the_secret() -> None:
    """The Prometheus chart's job for specserve: its bearer token is the file the secret `specserve` mounts as,
    the key the Deployment reads; it keeps the Deployment's pods at their port, and labels each series with what
    the adapter's rule selects on."""
    job, values = _k8s_prometheus_job()
    deployment = k8s_objects()["Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [key] = [e for e in container["env"] if e["name"] == "SPECSERVE_API_KEY"]
    secret = key["valueFrom"]["secretKeyRef"]
    [mount] = values["server"]["extraSecretMounts"]
    assert mount["secretName"] == secret["name"] and mount["readOnly"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": f"{mount['mountPath']}/{secret['key']}"}
    assert job["metrics_path"] == "/metrics" and job["kubernetes_sd_configs"] == [{"role": "pod"}]
    [keep] = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    label = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    [port] = container["ports"]
    assert keep["source_labels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_name",
        "__meta_kubernetes_pod_container_port_name",
    ]
    assert keep["regex"] == f"{label};{port['name']}"
    made = {r["target_label"]: r["source_labels"] for r in job["relabel_configs"] if "target_label" in r}
    assert made == {"namespace": ["__meta_kubernetes_namespace"], "pod": ["__meta_kubernetes_pod_name"]}
    adapter = yaml.safe_load((DOCKER / "k8s" / "prometheus-adapter-values.yaml").read_text())
    [rule] = adapter["rules"]["custom"]
    assert set(rule["resources"]["overrides"]) <= set(made)


def test_promtool_checks_the_k8s_prometheus_job(tmp_path: Path) -> None:
    """The job as the chart's Prometheus loads it, but for its pod discovery (Debian's promtool, CI's, is built
    without Kubernetes discovery): a static target instead."""
    job, _ = _k8s_prometheus_job()
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["localhost:8000"]}]
    _promtool_check({"scrape_configs": [job]}, tmp_path)


def test_shutdown_grace_fits_in_what_the_orchestrators_give() -> None:
    """The server's drain (requests in flight finish, the rest end with an error event) ends 5 s or more
    before Kubernetes or Docker send SIGKILL, and matches in both."""
    [container] = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    k8s_grace = float({e["name"]: e.get("value") for e in container["env"]}["SPECSERVE_SHUTDOWN_GRACE_PERIOD"])
    k8s_kill = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert k8s_grace + 5 <= k8s_kill
    for name in SPECSERVE_SERVICES:
        service = SERVICES[name]
        compose_grace = float(service["environment"]["SPECSERVE_SHUTDOWN_GRACE_PERIOD"])
        compose_kill = service["stop_grace_period"]
        assert compose_kill.endswith("s") and compose_grace + 5 <= float(compose_kill[:-1])
        assert compose_grace == k8s_grace
    assert Settings().shutdown_grace_period == k8s_grace  # the default is what the manifests say


def test_k8s_autoscaler_follows_an_exported_queue_metric(exported: set[str]) -> None:
    objects = k8s_objects()
    hpa = objects["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", objects["Deployment"]["metadata"]["name"])
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "specserve_num_requests_waiting" and name in exported
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # prometheus-adapter serves that name from that series.
    adapter = yaml.safe_load((DOCKER / "k8s" / "prometheus-adapter-values.yaml").read_text())
    [rule] = adapter["rules"]["custom"]
    assert rule["name"]["as"] == name
    assert promql_metrics(rule["seriesQuery"]) == {name}
    assert re.fullmatch(rule["name"]["matches"], name)


# --- make docker-test (docker/ci/) -------------------------------------------------------------------------


def test_docker_test_sets_only_variables_compose_reads() -> None:
    """What docker/ci/test.sh exports to compose (local images, the wheel, free ports) is what the compose file
    reads: a name that drifted would leave compose on Docker Hub's image or the default port."""
    script = (DOCKER / "ci" / "test.sh").read_text()
    exported = {name for line in re.findall(r"^export (.+)$", script, re.M) for name in line.split()}
    compose_text = (ROOT / "docker-compose.yml").read_text()
    read = set(re.findall(r"\$\{(\w+)", compose_text))
    assert {"BASE_IMAGE", "TORCH_WHEEL", "PROMETHEUS_IMAGE", "NGINX_IMAGE", "API_PORT", "LB_PORT"} <= exported
    assert exported <= read, exported - read
    # The stand-in images build from targets of one Dockerfile; Prometheus' takes compose's flags as prom/prometheus.
    services = (DOCKER / "ci" / "services.Dockerfile").read_text()
    assert set(re.findall(r"^FROM \S+ AS (\w+)$", services, re.M)) == {"packages", "prometheus", "nginx"}
    assert 'ENTRYPOINT ["/usr/bin/prometheus"]' in services
    assert all(flag.startswith("--") for flag in SERVICES["prometheus"]["command"])
