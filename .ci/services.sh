#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ if they are installed here but not answering.
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
exit 0
