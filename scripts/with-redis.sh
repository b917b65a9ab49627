#!/usr/bin/env bash
# Run a command with a private Redis server on a free loopback port; stop it afterwards.
# Installs redis-server (and the other test packages) with apt-get when absent. Exports QUICEDGE_TEST_REDIS_URL.
set -euo pipefail

bash "$(dirname "$0")/ensure-system-packages.sh"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --dir "$dir" \
  --daemonize no --loglevel warning >"$dir/redis.log" 2>&1 &
redis_pid=$!
cleanup() { kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT INT TERM

for _ in $(seq 1 100); do
  if redis-cli -p "$port" ping >/dev/null 2>&1; then break; fi
  sleep 0.05
done
redis-cli -p "$port" ping >/dev/null || { echo "redis-server did not start:" >&2; cat "$dir/redis.log" >&2; exit 1; }

export QUICEDGE_TEST_REDIS_URL="redis://127.0.0.1:$port/0"
echo "test Redis: $QUICEDGE_TEST_REDIS_URL" >&2
"$@"
