#!/bin/sh
# The entry point of the `lb` service (docker-compose.yml): writes the upstream servers of nginx.conf, one per
# address of the alias the specserve containers share, starts nginx, and every LB_RESOLVE_SECONDS looks the
# alias up again, rewriting the servers and reloading nginx (SIGHUP: the old workers finish their requests)
# when the addresses changed. nginx resolves an upstream's names only at start, and hashes a server line's
# name rather than its addresses, so the alias itself in nginx.conf would neither follow --scale nor hash
# (docs/deploy.md, Scaling out). POSIX sh and what both nginx images have (Debian's: getent; Alpine's:
# busybox nslookup).
#
#   LB_POOL             names to look up, each address a server (default specserve-pool; IP addresses too)
#   LB_POOL_PORT        their port (default 8000)
#   LB_BALANCE          affinity (default: the tenant's key, hashed consistently), round-robin or least-conn
#   LB_RESOLVE_SECONDS  how often to look again (default 5)
#   NGINX_CONF          nginx's configuration (default /etc/nginx/nginx.conf); the servers go beside it, in
#                       specserve-pool.conf
# Arguments go to nginx (after -c NGINX_CONF, before -g 'daemon off;').
set -eu

POOL=${LB_POOL:-specserve-pool}
PORT=${LB_POOL_PORT:-8000}
BALANCE=${LB_BALANCE:-affinity}
EVERY=${LB_RESOLVE_SECONDS:-5}
CONF=${NGINX_CONF:-/etc/nginx/nginx.conf}
SERVERS=$(dirname "$CONF")/specserve-pool.conf

case $BALANCE in
  affinity) METHOD='hash $specserve_affinity consistent;' ;;
  round-robin) METHOD='' ;;
  least-conn) METHOD='least_conn;' ;;
  *)
    echo "lb: LB_BALANCE must be affinity, round-robin or least-conn, not '$BALANCE'" >&2
    exit 2
    ;;
esac

addresses() { # every IPv4 address of every name of the pool, sorted: the same set, the same text
  for name in $POOL; do
    if [ -z "$(echo "$name" | tr -d 0-9.)" ]; then
      echo "$name" # an address already
    elif getent ahostsv4 "$name" >/dev/null 2>&1; then
      getent ahostsv4 "$name" | awk '{ print $1 }'
    else # musl's getent has no ahostsv4: busybox's nslookup, its answers after the first Name: line
      nslookup "$name" 2>/dev/null | awk '/^Name:/ { answer = 1 } answer && /^Address/' |
        grep -Eo '([0-9]{1,3}\.){3}[0-9]{1,3}' || true
    fi
  done | sort -u
}

write_servers() { # $1: the addresses; writes the upstream's servers when they changed (status 0), else 1
  {
    echo "# Written by lb.sh from $POOL (LB_BALANCE=$BALANCE); rewritten when its addresses change."
    [ -z "$METHOD" ] || echo "$METHOD"
    if [ -z "$1" ]; then
      # Nothing resolves yet: a server that is down, so that nginx starts (and answers 502) until one does.
      echo "server 127.0.0.1:$PORT down;"
    fi
    for address in $1; do
      # max_fails=0: no failure takes a server out. nginx would count a 429 as one, and with every
      # replica full would answer 502 for fail_timeout instead of the replicas' 429s (with Retry-After),
      # and go on doing so after one has room again. A replica that is gone costs each try of its tenants
      # a refused connection or the 1 s connect timeout, until the next look-up drops its address.
      echo "server $address:$PORT max_fails=0;"
    done
  } >"$SERVERS.new"
  if [ -f "$SERVERS" ] && cmp -s "$SERVERS.new" "$SERVERS"; then
    rm -f "$SERVERS.new"
    return 1
  fi
  mv "$SERVERS.new" "$SERVERS"
}

current=$(addresses)
write_servers "$current" || true
echo "lb: $BALANCE over $(echo $current | wc -w) servers of $POOL: $(echo $current)" >&2

# After the exec below this shell's pid ($$) is nginx's master: the loop signals it, and ends when it does.
(
  while sleep "$EVERY" && kill -0 $$ 2>/dev/null; do
    found=$(addresses)
    if write_servers "$found"; then
      echo "lb: $POOL is now $(echo $found | wc -w) servers: $(echo $found); reloading nginx" >&2
      kill -HUP $$
    fi
  done
) &

exec nginx -c "$CONF" "$@" -g 'daemon off;'
