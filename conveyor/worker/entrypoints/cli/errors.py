"""The errors a command shows as one line, ``conveyor: error: ...``, and its exit codes."""

from __future__ import annotations

from conveyor.worker.entrypoints.cli.extra import worker_extra

with worker_extra():
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import OperationalError as DBError

    from conveyor.worker.batchio.records import InputError
    from conveyor.worker.broker.queues import BrokerUnavailable
    from conveyor.worker.core.settings import ConfigError
    from conveyor.worker.entrypoints.client import JobFailed, JobNotFinished
    from conveyor.worker.jobs.lifecycle import JobNotFound, NotRetryable
    from conveyor.worker.jobs.model_names import InvalidModel
    from conveyor.worker.jobs.object_keys import InvalidJobId
    from conveyor.worker.jobs.submission import SubmitError
    from conveyor.worker.jobs.unfinished_reads import NotEnded, NoUnfinished
    from conveyor.worker.store.api_keys import KeyNameError, KeyNotFound
    from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, StorageUnavailable
    from conveyor.worker.store.schema import SchemaError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error to show as one line, without a traceback."""


def user_error_types() -> tuple[type[BaseException], ...]:
    return (
        UserError, ConfigError, InputError, InvalidModel, InvalidJobId, JobNotFound, JobNotFinished, JobFailed,
        SubmitError,
        NotRetryable, NotEnded, NoUnfinished,
        SchemaError, KeyNameError, KeyNotFound, ObjectNotFound, InvalidKey, StorageUnavailable,
        BrokerUnavailable,
        FileNotFoundError, IsADirectoryError, PermissionError, TimeoutError, ValueError, DBError, BrokerError,
    )  # fmt: skip


def describe(exc: BaseException) -> str:
    if isinstance(exc, DBError):
        lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return f"cannot use the database: {lines[0] if lines else type(exc).__name__}"
    text = str(exc) or type(exc).__name__
    if type(exc).__module__.startswith("kombu"):
        return f"cannot reach the broker: {text}"
    return text
