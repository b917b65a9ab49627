#!/usr/bin/env bash
# `make run`: the local stack on its embedded defaults — in-memory state, two CPU stand-in
# backends, generated development certificates — in the foreground until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
SIM_PROFILE=${SIM_PROFILE:-h100-llama3-8b}
SIM_PORTS=(${SIM_PORTS:-30001 30002})

pids=()
ready=
cleanup() {
  # Every job still running, not only those in $pids: a Ctrl-C between a `&` and the
  # `pids+=($!)` after it runs this before that child's pid is kept.
  for pid in "${pids[@]}" $(jobs -p); do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ -n $ready ]]; then rm -rf "$ready"; fi
}
# The traps come before the first command. Without one, bash takes a Ctrl-C that reaches it
# while a child runs as handled when that child exits normally (it had just ended, say), and
# goes on: a Ctrl-C as `quicedge certs` ended was missed and the whole stack started.
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$bin/quicedge" certs >/dev/null
ready=$(mktemp -d)

backends=()
for i in "${!SIM_PORTS[@]}"; do
  port=${SIM_PORTS[$i]}
  "$bin/quicedge" sim --host 127.0.0.1 --port "$port" --name "sim-$((i + 1))" \
    --profile "$SIM_PROFILE" --enable-metrics --enable-cache-report >"$ready/$port" &
  pids+=($!)
  backends+=(--backend "http://127.0.0.1:$port")
done
# Each stand-in prints `ready URL` once it listens. One that exits first (its port held by
# another process, say) or is not up within 30 s stops the script here: the edge must not start
# in front of whatever else answers on that port.
for i in "${!SIM_PORTS[@]}"; do
  port=${SIM_PORTS[$i]}
  for _ in $(seq 1 300); do
    grep -q '^ready ' "$ready/$port" 2>/dev/null && continue 2
    kill -0 "${pids[$i]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "run-local: the stand-in backend on 127.0.0.1:$port did not start (see above)" >&2
  exit 1
done

ca=certs/dev/ca.pem
body='{"model": "default", "max_tokens": 32, "stream": true, "messages": [{"role": "user", "content": "Say hello"}]}'
cat <<MSG

quicedge local stack: edge on h3 127.0.0.1:4433 (UDP), h2/h1 127.0.0.1:8443 (TCP), admin 127.0.0.1:9901,
backends ${backends[*]} (CPU stand-ins, profile $SIM_PROFILE).

Send a request over HTTP/3 (run it twice: the second goes in 0-RTT with the saved ticket):
  $bin/quicedge request https://127.0.0.1:4433/v1/chat/completions --h3 --cacert $ca \\
      --ticket /tmp/quicedge-ticket --json '$body'
over HTTP/2 (add --http1.1 for HTTP/1.1):
  curl --cacert $ca https://localhost:8443/v1/chat/completions -H 'content-type: application/json' \\
      -d '$body'
Fleet state: curl http://127.0.0.1:9901/backends    Metrics: curl http://127.0.0.1:9901/metrics
Tenants and quotas: curl http://127.0.0.1:9901/tenants    Reload: curl -X POST http://127.0.0.1:9901/config/reload
Take a backend out and back: curl -X POST http://127.0.0.1:9901/backends/127.0.0.1:${SIM_PORTS[0]}/drain
  (then .../undrain); a stored conversation: curl --cacert $ca https://localhost:8443/v1/responses \\
      -H 'content-type: application/json' -d '{"input": "Hi"}', then GET /v1/responses/ID.
Press Ctrl-C to stop.

MSG
"$bin/quicedge" serve "${backends[@]}" &
pids+=($!)
wait "${pids[-1]}"
