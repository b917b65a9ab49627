#!/usr/bin/env bash
# Install the Debian packages the test suite needs, only those that are missing:
#   redis-server   the real Redis the state-store tests run against
#   ngtcp2-client  gtlsclient, an HTTP/3 client independent of aioquic, for interop tests
#   prometheus     prometheus and promtool: the deployment tests check the Prometheus config and
#                  rules, and scrape a running edge with a real Prometheus
#   chromium       a real browser: a page on another origin streams through the edge (CORS)
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v gtlsclient >/dev/null 2>&1 || missing+=(ngtcp2-client)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing system packages: ${missing[*]} (run as root, or install them with apt-get)" >&2
  exit 1
fi
echo "installing with apt-get: ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
