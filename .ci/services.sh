#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ if they are installed here but not answering; on CI
# (CI=true), install Prometheus if it is missing: the autoscaling system test
# (tests/worker/entrypoints/test_autoscaling.py) starts a server of its own from that binary.
up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! up 5432 && command -v pg_ctlcluster >/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
if ! up 6379 && command -v redis-server >/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no || true
fi
if ! up 5672 && command -v rabbitmq-server >/dev/null; then
  rabbitmq-server -detached || true
  for _ in $(seq 1 30); do up 5672 && break; sleep 1; done
fi
if ! command -v prometheus >/dev/null && [ "${CI:-}" = "true" ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    || { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; } \
    || true
fi
exit 0
