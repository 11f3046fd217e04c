"""Private service instances a fault run may stop, restart and cut without touching the machine's
shared PostgreSQL, Redis or RabbitMQ: a PostgreSQL cluster (initdb/pg_ctl in a temp directory),
a redis-server without persistence, a RabbitMQ node, and moto's S3 server behind a ``TcpProxy``. Each listens on
a free port of 127.0.0.1 and is stopped by ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.worker.helpers import _die_with_parent
from tests.worker.services import free_port
from tests.worker.tcp_proxy import TcpProxy


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the ``postgres`` user."""
    if os.geteuid() == 0 and shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


class PrivatePostgres:
    """A throwaway cluster: trust authentication, no fsync (a benchmark, not a durability test)."""

    def __init__(self) -> None:
        # A directory of its own under the system temp dir: the ``postgres`` user must reach it
        # (pytest's temp directories are private to root).
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
        self.dir = self.root / "pgdata"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        subprocess.run(
            _as_postgres(["initdb", "-D", str(self.dir), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
        )
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300"
        subprocess.run(
            _as_postgres(["pg_ctl", "-D", str(self.dir), "-o", options, "-l", str(self.log), "-w", "start"]),
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        subprocess.run(_as_postgres(["pg_ctl", "-D", str(self.dir), "-m", "fast", "-w", "stop"]), capture_output=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    """A redis-server with no persistence: a restart comes back empty (the broker's messages lost)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir)]
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 15
        import redis

        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if redis.Redis(port=self.port, socket_connect_timeout=1).ping():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server on {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart_empty(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()


class PrivateRabbitMQ:
    """A RabbitMQ node of its own (name, ports, cookie, data and logs under ``workdir``) that a
    test may SIGKILL and start again: ``restart_empty`` wipes its data first, as a node whose
    disk was lost (its queues and messages gone)."""

    SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the script itself: the wrapper runs as another user

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "enabled_plugins").write_text("[].\n")
        self.port = free_port()
        self.node = f"conveyor-t{self.port}@localhost"
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def env(self) -> dict[str, str]:
        w = self.workdir
        return {
            **os.environ, "HOME": str(w), "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(w / "mnesia"), "RABBITMQ_LOG_BASE": str(w / "log"),
            "RABBITMQ_PID_FILE": str(w / "rabbitmq.pid"), "RABBITMQ_ENABLED_PLUGINS_FILE": str(w / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(w / "rabbitmq"),
        }  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        with open(self.workdir / "rabbitmq.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self.SERVER], cwd=self.workdir, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        from kombu import Connection

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server on {self.port} exited: see {self.workdir / 'rabbitmq.log'}")
            with contextlib.suppress(Exception), Connection(self.url, connect_timeout=1) as conn:
                conn.ensure_connection(max_retries=1)
                return
            time.sleep(0.2)
        raise RuntimeError(f"rabbitmq-server on {self.port} did not start in {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL the node (the script and the Erlang VM it started share a process group)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def restart_empty(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir / "mnesia", ignore_errors=True)
        self.start()

    def close(self) -> None:
        self.kill()


class PrivateS3:
    """moto's S3 server, reached through a proxy that can refuse connections (``proxy.cut()``)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
        port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.proxy = TcpProxy("127.0.0.1", port)
        self.endpoint = f"http://{self.proxy.url_host()}"
        self.bucket = "conveyor-faults"
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **self.credentials()).create_bucket(
            Bucket=self.bucket
        )

    @staticmethod
    def credentials() -> dict[str, str]:
        return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
        }  # fmt: skip

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()
