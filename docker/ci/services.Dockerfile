# Prometheus and nginx from Debian's packages, for docker/ci/test.sh: where Docker Hub is out of reach, these
# stand in for prom/prometheus and nginx:*-alpine (compose's PROMETHEUS_IMAGE and NGINX_IMAGE). Each target
# behaves as the image it replaces: the same entry point, user and paths, so that docker-compose.yml runs them
# unchanged. BASE_IMAGE: the Debian bookworm that docker/ci/test.sh makes.
ARG BASE_IMAGE
FROM ${BASE_IMAGE} AS packages
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx prometheus \
 && rm -rf /var/lib/apt/lists/*

FROM packages AS prometheus
# prom/prometheus: /prometheus owned by nobody (the compose volume starts as a copy of it), flags from compose.
RUN mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]

FROM packages AS nginx
# nginx:alpine: the configuration mounted at /etc/nginx/nginx.conf, nginx in the foreground.
EXPOSE 8080
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
