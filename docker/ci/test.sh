#!/usr/bin/env bash
# `make docker-test` (and .ci/run): the image and the compose stack built and run for real, on a machine with
# Debian's packages and PyPI but neither Docker Hub nor PyTorch's index (docs/deploy.md, How these files are
# tested). As root. Every step must pass; on exit, whatever the outcome, everything this script started is
# stopped and removed and the host's network settings are put back, but the images stay in Docker's cache
# (/var/lib/docker) so that the next run builds in seconds (DOCKER_TEST_REMOVE_IMAGES=1 removes them too).
#
#  1. docker.io, docker-compose and mmdebstrap from Debian; a dockerd of our own unless one already runs.
#  2. A Debian bookworm base image (mmdebstrap + docker import) with python3, trusting this host's extra CA
#     certificates (outbound TLS may be re-signed); Prometheus and nginx images from Debian's packages.
#  3. specserve's image, built by compose from docker/Dockerfile with that base and the torch wheel this
#     host's pip has (pip download: its local wheel directory or PyPI).
#  4. The container alone, hardened as docker/k8s runs it (read-only root, no capabilities, no new
#     privileges): health, a generation, a chat, /metrics, uid 10001, a restart from the model volume.
#  5. compose: specserve + Prometheus; Prometheus reads the acceptance counters /metrics has, and every query
#     of the Grafana dashboard returns data.
#  6. compose --profile scaled: 3 replicas more behind nginx; requests through nginx reach all 4 containers;
#     each tenant's requests reach one container, and a second turn finds the first in its prefix cache; a
#     killed replica's tenants are answered by another within 5 s.
#  7. `docker-compose stop specserve` while a 400-token generation runs: it finishes, the server exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT=specserve-ci
HARDENED=specserve-ci-hardened
CACHE_VOLUME=${PROJECT}_model-cache # compose's name for the model-cache volume of project $PROJECT
PROMETHEUS_IMAGE=specserve-ci/prometheus:debian
NGINX_IMAGE=specserve-ci/nginx:debian
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile)
# Debian's client, which matches Debian's daemon (a newer client may come first on PATH).
DOCKER=/usr/bin/docker
WORK=$(mktemp -d /tmp/specserve-docker-test.XXXXXX)
STARTED=$SECONDS
DOCKERD_PID=
WHEEL_COPY=
FAILED_AT=
STEPS=0

step() {
  FAILED_AT=$*
  STEPS=$((STEPS + 1))
  printf '\n== %s  [%ds]\n' "$*" $((SECONDS - STARTED))
}

# The server defaults are what is tested: no SPECSERVE_* of the caller's reaches compose.
while read -r name; do unset "$name"; done < <(compgen -e | grep '^SPECSERVE_' || true)

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
API_PORT=$(free_port)
PROMETHEUS_PORT=$(free_port)
LB_PORT=$(free_port)
GRAFANA_PORT=$(free_port)
HARDENED_PORT=$(free_port)
export API_PORT PROMETHEUS_PORT LB_PORT GRAFANA_PORT PROMETHEUS_IMAGE NGINX_IMAGE

compose() {
  docker-compose --project-name "$PROJECT" --env-file "$WORK/empty.env" --profile scaled "$@"
}
: >"$WORK/empty.env" # a developer's .env (an API key, other ports) is not this test's

restore_network() {
  # dockerd adds the docker0 bridge, filter and nat rules and turns on forwarding; put back what was there.
  ip link delete docker0 2>/dev/null || true
  local table chain
  for table in filter nat; do
    if grep -q "^\*$table" "$WORK/iptables.before"; then
      sed -n "/^\*$table/,/^COMMIT/p" "$WORK/iptables.before" | iptables-restore
    else
      iptables -t "$table" -F && iptables -t "$table" -X
      for chain in $(iptables -t "$table" -S | sed -n 's/^-P \(\S*\) .*/\1/p'); do
        iptables -t "$table" -P "$chain" ACCEPT
      done
    fi
  done
  sysctl -q -w "net.ipv4.ip_forward=$(cat "$WORK/ip_forward.before")"
}

cleanup() {
  local rc=$?
  set +e
  if [ "$rc" -ne 0 ]; then
    echo "FAILED at: $FAILED_AT (exit $rc)" >&2
    if $DOCKER info >/dev/null 2>&1; then
      $DOCKER logs --tail=20 "$HARDENED" 2>/dev/null >&2
      compose logs --no-color --tail=15 2>/dev/null >&2
    elif [ -n "$DOCKERD_PID" ]; then
      tail -n 20 "$WORK/dockerd.log" >&2
    fi
  fi
  if $DOCKER info >/dev/null 2>&1; then
    compose down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1
    $DOCKER rm -f "$HARDENED" >/dev/null 2>&1
    $DOCKER volume rm "$CACHE_VOLUME" >/dev/null 2>&1
    if [ "${DOCKER_TEST_REMOVE_IMAGES:-0}" = 1 ]; then
      $DOCKER image rm specserve:cpu "$PROMETHEUS_IMAGE" "$NGINX_IMAGE" "$BASE_IMAGE" >/dev/null 2>&1
    fi
  fi
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
    restore_network
  fi
  [ -n "$WHEEL_COPY" ] && rm -f "$WHEEL_COPY"
  rm -rf "$WORK"
  printf '\n== docker-test %s in %ds\n' "$([ "$rc" -eq 0 ] && echo passed || echo FAILED)" $((SECONDS - STARTED))
  # The closing line CI reads: each step a test.
  if [ "$rc" -eq 0 ]; then
    echo "docker-test: $STEPS passed, 0 failed"
  else
    echo "docker-test: $((STEPS > 0 ? STEPS - 1 : 0)) passed, 1 failed"
  fi
  exit "$rc"
}
trap cleanup EXIT

# --- 1. Docker -------------------------------------------------------------------------------------------
step "packages: docker.io docker-compose mmdebstrap"
missing=()
for package in docker.io docker-compose mmdebstrap; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

step "dockerd"
if $DOCKER info >/dev/null 2>&1; then
  echo "a Docker engine already runs: using it, and leaving it running"
else
  iptables-save >"$WORK/iptables.before"
  sysctl -n net.ipv4.ip_forward >"$WORK/ip_forward.before"
  dockerd --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    $DOCKER info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || { cat "$WORK/dockerd.log" >&2; exit 1; }
    sleep 0.5
  done
  $DOCKER info --format 'Docker {{.ServerVersion}}, {{.Driver}}'
fi

# --- 2. Base and service images --------------------------------------------------------------------------
# The base is named after the CA certificates it trusts: new certificates, a new base.
CA_FILES=$(find /usr/local/share/ca-certificates -name '*.crt' 2>/dev/null | sort)
CA_SUM=$(cat /dev/null $CA_FILES | sha256sum | cut -c1-12)
BASE_IMAGE=specserve-ci/base:bookworm-$CA_SUM
step "base image $BASE_IMAGE"
if ! $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  # This host's Debian mirror (apt reaches it), for the base and for the apt-get runs inside the builds.
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
  # policy-rc.d: packages installed in a build do not try to start their services (as Debian's own images).
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --customize-hook='printf "#!/bin/sh\nexit 101\n" >"$1/usr/sbin/policy-rc.d" && chmod 755 "$1/usr/sbin/policy-rc.d"' \
    --customize-hook='for crt in /usr/local/share/ca-certificates/*.crt; do [ ! -e "$crt" ] || cp "$crt" "$1/usr/local/share/ca-certificates/"; done' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    bookworm "$WORK/base.tar" "$mirror" </dev/null
  # A file, not a pipe: a bootstrap that fails half-way must not leave a half image behind.
  $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["bash"]' "$WORK/base.tar" "$BASE_IMAGE" >/dev/null
  rm "$WORK/base.tar"
fi
export BASE_IMAGE

step "Prometheus and nginx images from Debian's packages"
for target in prometheus nginx; do
  image=$PROMETHEUS_IMAGE
  [ "$target" = nginx ] && image=$NGINX_IMAGE
  $DOCKER build -q -f docker/ci/services.Dockerfile --target "$target" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -t "$image" docker/ci >/dev/null
done

# --- 3. specserve's image --------------------------------------------------------------------------------
step "torch $TORCH_VERSION wheel from this host's pip"
# For the base's Python (bookworm: 3.11), whatever the host's is.
python3 -m pip download -q "torch==$TORCH_VERSION" --no-deps --only-binary=:all: --python-version 3.11 \
  -d "$WORK/wheels"
wheel=$(find "$WORK/wheels" -name 'torch-*.whl' | head -n 1)
case $wheel in
  *+cpu*) ;;
  *) echo "warning: $(basename "$wheel") is not a CPU build: the image pulls CUDA libraries (GBs) from PyPI" ;;
esac
TORCH_WHEEL=$(basename "$wheel")
WHEEL_COPY=docker/wheels/$TORCH_WHEEL
[ -e "$WHEEL_COPY" ] && WHEEL_COPY= # the caller's own: leave it
cp -l "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
export TORCH_WHEEL

step "compose build specserve (BASE_IMAGE=$BASE_IMAGE TORCH_WHEEL=$TORCH_WHEEL)"
if ! compose build specserve >"$WORK/build.log" 2>&1; then
  tail -n 60 "$WORK/build.log" >&2
  exit 1
fi
$DOCKER image inspect specserve:cpu --format 'specserve:cpu {{.Size}} bytes, user {{.Config.User}}'
[ "$($DOCKER image inspect specserve:cpu --format '{{.Config.User}}')" = specserve ]

# --- 4. The container alone, hardened --------------------------------------------------------------------
step "hardened container: read-only root, no capabilities"
# The compose project's volume, labelled as compose labels it: the stack below finds the model there.
$DOCKER volume create --label "com.docker.compose.project=$PROJECT" --label com.docker.compose.volume=model-cache \
  "$CACHE_VOLUME" >/dev/null
$DOCKER run -d --name "$HARDENED" --read-only --cap-drop ALL --security-opt no-new-privileges \
  --tmpfs /tmp:rw,exec,nosuid,nodev,size=512m --tmpfs /home/specserve:rw,nosuid,nodev,uid=10001,gid=10001 \
  -v "$CACHE_VOLUME:/var/cache/specserve" -p "127.0.0.1:$HARDENED_PORT:8000" \
  -e SPECSERVE_ALLOW_UNAUTHENTICATED=true specserve:cpu >/dev/null  # published on 127.0.0.1 only
python3 docker/ci/checks.py server "http://127.0.0.1:$HARDENED_PORT"

wait_healthy() { # Docker's own health check (what compose's depends_on waits for)
  local status
  for _ in $(seq 120); do
    status=$($DOCKER inspect --format '{{.State.Health.Status}}' "$1")
    [ "$status" = healthy ] && return 0
    sleep 1
  done
  echo "$1 is $status, not healthy" >&2
  return 1
}
wait_healthy "$HARDENED"
uid=$($DOCKER exec "$HARDENED" stat -c %u /proc/1)
caps=$($DOCKER exec "$HARDENED" sed -n 's/^CapEff:\s*//p' /proc/1/status)
echo "server process: uid $uid, effective capabilities $caps"
if [ "$uid" != 10001 ] || [ "$caps" != 0000000000000000 ]; then
  echo "the server runs as uid $uid with capabilities $caps, not 10001 with none" >&2
  exit 1
fi
if $DOCKER exec "$HARDENED" touch /opt/specserve/written 2>/dev/null; then
  echo "the root filesystem is writable" >&2
  exit 1
fi

step "restart: the model from the volume, no download"
since=$(date +%s)
$DOCKER restart --time 30 "$HARDENED" >/dev/null
python3 docker/ci/checks.py server "http://127.0.0.1:$HARDENED_PORT"
$DOCKER logs --since "$since" "$HARDENED" >"$WORK/restart.log" 2>&1
grep -q 'already fetched and verified' "$WORK/restart.log"
if grep -q 'downloading' "$WORK/restart.log"; then
  echo "the restart downloaded the model again" >&2
  exit 1
fi
$DOCKER rm -f "$HARDENED" >/dev/null

# --- 5. compose: specserve + Prometheus ------------------------------------------------------------------
step "compose up specserve prometheus"
compose up -d --no-build specserve prometheus
python3 docker/ci/checks.py server "http://127.0.0.1:$API_PORT"
python3 docker/ci/checks.py prometheus "http://127.0.0.1:$PROMETHEUS_PORT" "http://127.0.0.1:$API_PORT"

# --- 6. compose --profile scaled: 4 specserve behind nginx -----------------------------------------------
step "compose --profile scaled up: 3 replicas and nginx"
compose up -d --no-build specserve-replica lb
python3 docker/ci/checks.py spread "http://127.0.0.1:$LB_PORT" "http://127.0.0.1:$PROMETHEUS_PORT" 4 \
  -- docker-compose --project-name "$PROJECT" --env-file "$WORK/empty.env" --profile scaled logs --no-color lb

step "tenant affinity through nginx; a killed replica's tenants served by another"
lb_log=(docker-compose --project-name "$PROJECT" --env-file "$WORK/empty.env" --profile scaled logs --no-color lb)
python3 docker/ci/checks.py affinity "http://127.0.0.1:$LB_PORT" "$WORK/tenants" -- "${lb_log[@]}"
victim=
for id in $(compose ps -q specserve-replica); do # a replica (step 7 stops specserve) that holds tenants
  address=$($DOCKER inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$id"):8000
  if grep -q " $address\$" "$WORK/tenants"; then
    victim=$id
    break
  fi
done
if [ -z "$victim" ]; then
  echo "no replica holds a tenant: $(cat "$WORK/tenants")" >&2
  exit 1
fi
$DOCKER kill "$victim" >/dev/null
python3 docker/ci/checks.py failover "http://127.0.0.1:$LB_PORT" "$address" "$WORK/tenants" -- "${lb_log[@]}"

# --- 7. Drain on stop ------------------------------------------------------------------------------------
step "compose stop specserve during a 400-token generation"
container=$(compose ps -q specserve)
python3 docker/ci/checks.py drain "http://127.0.0.1:$API_PORT" \
  -- docker-compose --project-name "$PROJECT" --env-file "$WORK/empty.env" --profile scaled stop specserve
exit_code=$($DOCKER inspect --format '{{.State.ExitCode}}' "$container")
echo "specserve exited with $exit_code"
[ "$exit_code" = 0 ]
FAILED_AT=
