"""Fixtures over real services: SQLite files, PostgreSQL (127.0.0.1:5432, database ``test``),
S3 through moto's server mode (real HTTP) and the local filesystem.

A service that is down skips its tests with a loud reason; with ``CI=true`` it fails them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# The API server fixtures every layer's tests may ask for (pytest finds fixtures by name here).
from tests.worker.api_server import serve, server  # noqa: F401 - fixtures, used by name
from tests.worker.services import AMQP_URL, PG_DB, PG_HOST, PG_PORT, PG_USERS, REDIS_URL, free_port, service_down
from tests.worker.webhook_receiver import receiver  # noqa: F401 - a fixture, used by name

# ---- PostgreSQL: a fresh schema per test ------------------------------------------------


@pytest.fixture(scope="session")
def pg_admin_user() -> str:
    try:
        import psycopg
    except ImportError as exc:
        service_down("PostgreSQL driver psycopg", str(exc))
    errors = []
    for user in PG_USERS:
        try:
            with psycopg.connect(host=PG_HOST, port=PG_PORT, user=user, dbname=PG_DB, connect_timeout=3):
                return user
        except psycopg.Error as exc:
            errors.append(f"{user}: {' '.join(str(exc).split())}")
    service_down(f"PostgreSQL at {PG_HOST}:{PG_PORT}/{PG_DB}", "; ".join(errors))


@pytest.fixture
def pg_url(pg_admin_user: str) -> Iterator[str]:
    """A URL whose search_path is a brand-new empty schema (dropped afterwards)."""
    import psycopg

    schema = f"conveyor_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, user=pg_admin_user, dbname=PG_DB, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield f"postgresql://{pg_admin_user}@{PG_HOST}:{PG_PORT}/{PG_DB}?options=-csearch_path%3D{schema}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, user=pg_admin_user, dbname=PG_DB, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty database: a SQLite file, or a fresh Postgres schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'conveyor.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def db_engine(db_url: str):
    """An engine on a database migrated to head."""
    from conveyor.worker.store.database import create_db_engine
    from conveyor.worker.store.schema import upgrade_database

    upgrade_database(db_url)
    engine = create_db_engine(db_url)
    yield engine
    engine.dispose()


# ---- S3 through moto's server (real HTTP) -------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        service_down("moto server (pip install 'moto[server]')", str(exc))
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        moto.start()
    except Exception as exc:
        service_down("moto S3 server", repr(exc))
    yield f"http://127.0.0.1:{port}"
    moto.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str) -> str:
    """Fake credentials and the moto endpoint in the environment (never real AWS)."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_endpoint


@pytest.fixture
def s3_bucket(aws_env: str) -> str:
    """A fresh bucket, with fake credentials and the endpoint in the environment."""
    import boto3

    name = f"conveyor-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def s3_client(s3_endpoint: str):
    """One client for the session (creating boto3 clients is slow); fake credentials."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(s3={"addressing_style": "path"}),
    )


@pytest.fixture(scope="session")
def shared_bucket(s3_client) -> str:
    name = f"conveyor-test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path):
    """An empty root object store: a local directory, or a fresh prefix in an S3 bucket."""
    from conveyor.worker.store.objects.local import LocalStore
    from conveyor.worker.store.objects.s3 import S3Store

    if request.param == "local":
        return LocalStore(tmp_path / "objects")
    client = request.getfixturevalue("s3_client")
    bucket = request.getfixturevalue("shared_bucket")
    return S3Store(bucket, f"test-{uuid.uuid4().hex[:12]}/root", client=client, part_size=5 * 1024 * 1024)


# ---- brokers: Redis and RabbitMQ, isolated per test --------------------------------------


@pytest.fixture
def redis_broker() -> Iterator[dict]:
    """The machine's Redis with a key prefix of this test's own (all its keys removed after)."""
    try:
        import redis
    except ImportError as exc:
        service_down("Redis client (pip install redis)", str(exc))
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_down(f"Redis at {REDIS_URL}", str(exc))
    prefix = f"conveyor-test-{uuid.uuid4().hex[:10]}:"
    yield {"broker_url": REDIS_URL, "broker_transport_options": {"global_keyprefix": prefix}}
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def amqp_broker() -> Iterator[dict]:
    """The machine's RabbitMQ; the test's queues (``<queue_prefix>-*``) are deleted after."""
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        service_down(f"RabbitMQ at {AMQP_URL}", repr(exc))
    created: list[str] = []
    yield {"broker_url": AMQP_URL, "_queues": created}
    with Connection(AMQP_URL, connect_timeout=3) as conn:
        channel = conn.default_channel
        for name in created:
            try:
                channel.queue_delete(name)
                channel.exchange_delete(name)
            except Exception:
                channel = conn.channel()


@pytest.fixture
def sqs_broker(s3_endpoint: str) -> dict:
    """Amazon SQS as moto's server answers it (the same server as S3; fake credentials).
    Needs kombu's SQS transport: ``pip install 'celery[sqs]'`` (in the dev extra)."""
    try:
        import pycurl  # noqa: F401 - what kombu's SQS transport needs beyond boto3
    except ImportError as exc:
        service_down("kombu's SQS transport (pip install 'celery[sqs]')", str(exc))
    host_port = s3_endpoint.removeprefix("http://")
    return {
        "broker_url": f"sqs://testing:testing@{host_port}",
        "broker_transport_options": {"region": "us-east-1", "is_secure": False},
    }


# ---- tiny model, per-test stacks and worker subprocesses --------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> str:
    return tiny_models("llama")


@pytest.fixture
def embedded_stack(tmp_path, tiny_model):
    """Embedded defaults: SQLite, kombu's SQLAlchemy broker on SQLite, a local directory."""
    from tests.worker.helpers import Stack, make_values

    return Stack(make_values(tmp_path / "home", tiny_model), tiny_model)


def _service_stack(tmp_path, tiny_model, pg_url, broker: dict, storage_url: str, extra_env: dict):
    from conveyor.worker.broker.queues import intake_queue_name, queue_name, submit_queue_name
    from conveyor.worker.jobs.model_names import canonical_model
    from conveyor.worker.store.schema import upgrade_database
    from tests.worker.helpers import Stack, make_values

    upgrade_database(pg_url)  # what `conveyor db upgrade` does; workers refuse an empty schema
    options = {k: v for k, v in broker.items() if not k.startswith("_")}
    values = make_values(tmp_path / "home", tiny_model, database_url=pg_url, storage_url=storage_url, **options)
    if "_queues" in broker:
        prefix = values["queue_prefix"]
        model_queue = queue_name(canonical_model(tiny_model), prefix)
        broker["_queues"] += [model_queue, intake_queue_name(prefix), submit_queue_name(prefix)]
    return Stack(values, tiny_model, extra_env)


def _aws_env(endpoint: str) -> dict:
    return {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
    }  # fmt: skip


@pytest.fixture
def pg_redis_s3_stack(tmp_path, tiny_model, pg_url, redis_broker, s3_bucket, aws_env):
    return _service_stack(tmp_path, tiny_model, pg_url, redis_broker, f"s3://{s3_bucket}/conveyor", _aws_env(aws_env))


@pytest.fixture
def pg_amqp_s3_stack(tmp_path, tiny_model, pg_url, amqp_broker, s3_bucket, aws_env):
    return _service_stack(tmp_path, tiny_model, pg_url, amqp_broker, f"s3://{s3_bucket}/conveyor", _aws_env(aws_env))


@pytest.fixture
def pg_sqs_s3_stack(tmp_path, tiny_model, pg_url, sqs_broker, s3_bucket, aws_env):
    return _service_stack(tmp_path, tiny_model, pg_url, sqs_broker, f"s3://{s3_bucket}/conveyor", _aws_env(aws_env))


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    """``env(stack)`` points the CLI at a stack through CONVEYOR_* variables, as a user would."""

    def use(stack, **overrides):
        for name in list(os.environ):
            if name.startswith("CONVEYOR_"):
                monkeypatch.delenv(name)
        for name, value in stack.env(**overrides).items():
            if name.startswith(("CONVEYOR_", "AWS_")):
                monkeypatch.setenv(name, value)
        return stack

    return use


@pytest.fixture
def spawn_worker(tmp_path):
    """``spawn_worker(stack, **kw)`` starts a worker subprocess (``args``: more command-line
    arguments; other keywords: settings); all are stopped after the test, pass or fail (and
    die with the test process if it is killed)."""
    from tests.worker.helpers import WorkerProc

    procs: list = []

    def spawn(stack, *, plain_celery: bool = False, concurrency: int = 2, args: tuple[str, ...] = (), **overrides):
        log = tmp_path / f"worker-{len(procs)}.log"
        proc = WorkerProc(
            stack.env(**overrides), log, plain_celery=plain_celery, concurrency=concurrency, extra_args=args
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


@pytest.fixture
def tcp_proxy():
    """``tcp_proxy(host, port)`` starts a ``TcpProxy`` to that service (a test cuts it for an
    outage); all are closed after the test."""
    from tests.worker.tcp_proxy import TcpProxy

    proxies: list[TcpProxy] = []

    def start(host: str, port: int) -> TcpProxy:
        proxy = TcpProxy(host, port)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


def pytest_configure(config) -> None:
    # kombu's SQLAlchemy transport uses a loader option SQLAlchemy 2.1 deprecates (not ours).
    config.addinivalue_line("filterwarnings", "ignore:The ``noload`` loader strategy:DeprecationWarning")
