#!/usr/bin/env bash
# Starts the demo on loopback: the idempotency store (embedded backend), a demo upstream and
# Envoy with the filter (envoy/envoy.yaml). `--replicas 2` starts a second Envoy sharing the
# same store (envoy/envoy-replica-2.yaml), as replicas behind a load balancer would.
# `--native` starts the filter's native build instead (envoy/envoy-native.yaml: single-proxy
# mode, no store). Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."

replicas=1
native=false
while (( $# )); do
    case $1 in
        --replicas) replicas="${2:-1}"; shift 2 ;;
        --native) native=true; shift ;;
        *) echo "usage: $0 [--replicas 1|2] [--native]" >&2; exit 2 ;;
    esac
done
if (( replicas < 1 || replicas > 2 )); then echo "--replicas is 1 or 2" >&2; exit 2; fi
if $native && (( replicas != 1 )); then echo "--native runs one Envoy (single-proxy mode)" >&2; exit 2; fi

run_dir=.run
mkdir -p "$run_dir"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# The same token the sample Envoy config sends; change both together. Operators (the
# `idempotency-store record` command) get a token of their own, which no Envoy holds.
printf 'demo-token-change-me\n' > "$run_dir/store-token"
printf 'demo-operator-token-change-me\n' > "$run_dir/operator-token"
target/release/idempotency-store --listen 127.0.0.1:8081 --backend embedded \
    --data-dir "$run_dir/store-data" --token-file "$run_dir/store-token" \
    --operator-token-file "$run_dir/operator-token" \
    > "$run_dir/store.log" 2>&1 &
pids+=($!)
target/release/demo-upstream --listen 127.0.0.1:8080 > "$run_dir/upstream.log" 2>&1 &
pids+=($!)

if $native; then
    ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$PWD/target/native" .venv/bin/envoy -c envoy/envoy-native.yaml \
        --concurrency 2 --disable-hot-restart --log-level warn \
        --component-log-level dynamic_modules:info --file-flush-interval-msec 500 \
        > "$run_dir/envoy-1.log" 2>&1 &
    pids+=($!)
    replicas=0
fi
for i in $(seq 1 "$replicas"); do
    # Replica 2 is envoy/envoy-replica-2.yaml: the same config on ports 10001 and 9902.
    config=envoy/envoy.yaml
    (( i == 2 )) && config=envoy/envoy-replica-2.yaml
    # The access log (one JSON line per request, on stdout) is flushed every 0.5 s.
    .venv/bin/envoy -c "$config" --concurrency 2 --disable-hot-restart --log-level warn \
        --component-log-level wasm:info --file-flush-interval-msec 500 \
        > "$run_dir/envoy-$i.log" 2>&1 &
    pids+=($!)
done

for _ in $(seq 1 100); do
    curl -sf -o /dev/null http://127.0.0.1:9901/ready && break
    sleep 0.1
done

if $native; then
    cat <<'TRY'
Envoy with the idempotency filter's native build is listening on http://127.0.0.1:10000
(admin :9901), single-proxy mode. Logs are in .run/. Try:

  # executes once, then the retry is a replay ("idempotent-replayed: true")
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"book"}'
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"book"}'
  # same key, different payload: 422; no key: 400
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"pen"}'
  curl -si -X POST localhost:10000/orders -d '{"sku":"book"}'
  # how many times did the upstream really execute /orders?
  curl -s 'localhost:8080/__count?path=/orders'
  curl -s localhost:9901/stats/prometheus | grep idempotency_rule

Ctrl-C stops everything.
TRY
    wait
    exit 0
fi
cat <<'TRY'
Envoy with the idempotency filter is listening on http://127.0.0.1:10000 (admin :9901).
Logs are in .run/. Try:

  # executes once (the demo upstream counts executions)
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"book"}'
  # the retry is a replay: same body, plus "idempotent-replayed: true"
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"book"}'
  # same key, different payload: 422
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: order-42' -d '{"sku":"pen"}'
  # no key: 400
  curl -si -X POST localhost:10000/orders -d '{"sku":"book"}'
  # a duplicate while the first is still running: 409
  curl -s -X POST localhost:10000/orders -H 'Idempotency-Key: slow-1' -H 'x-demo-delay-ms: 3000' -d x &
  sleep 0.5; curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: slow-1' -d x
  # a client that gives up after 1 s on a 3 s payment: its retry is never run again, not
  # charged twice. First 409 outcome-unknown with Retry-After while the filter waits out the
  # settle time (5 s) and asks the service GET /payments/by-key/pay-7; then the payment itself,
  # with "idempotent-resolved: true"
  curl -s -m 1 -X POST localhost:10000/payments -H 'Idempotency-Key: pay-7' -H 'x-demo-delay-ms: 3000' -d '{"amount":5}'
  curl -si -X POST localhost:10000/payments -H 'Idempotency-Key: pay-7' -d '{"amount":5}'
  sleep 6; curl -si -X POST localhost:10000/payments -H 'Idempotency-Key: pay-7' -d '{"amount":5}'
  # what the filter holds for your key (your own only), without running anything
  curl -s localhost:10000/payments/idempotency-status -H 'Idempotency-Key: pay-7'
  # how many times did the upstream really execute /orders?
  curl -s 'localhost:8080/__count?path=/orders'
  # what the store holds for the payment whose client gave up (resolved: the payment)
  target/release/idempotency-store record show --operator-token-file .run/operator-token \
    --rule payments -H 'Host: localhost:10000' --key pay-7
  # the counters on-call watches
  curl -s localhost:9901/stats/prometheus | grep idempotency_rule
TRY
if (( replicas > 1 )); then
    echo "  # replica 2 on :10001 replays what replica 1 recorded (shared store; the Host is"
    echo "  # part of the default scope, so send the one clients use for both replicas)"
    echo "  curl -si -X POST localhost:10001/orders -H 'Host: localhost:10000' -H 'Idempotency-Key: order-42' -d '{\"sku\":\"book\"}'"
fi
echo
echo "Press Ctrl-C to stop."
wait
