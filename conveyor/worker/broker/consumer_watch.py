"""The Celery consumer of a worker process: what it consumes, as ``/readyz`` reports it, and
what it does when an acknowledgement finds the broker connection gone.

A task's message is acknowledged when the task ends (late acks). A task that ends while the
broker is down cannot be: Celery logs ``Couldn't ack`` and goes on, and kombu's virtual
transports (Redis) keep the message counted against the channel's prefetch. Once the running
tasks of every slot have ended that way, the channel may take no message, so the Redis
transport stops sending BRPOP; and it learns of a lost connection only by reading a BRPOP
reply. The consumer then waits forever on a dead connection: it never reconnects, and the
queues fill while the worker looks connected (issue 40; kombu 5.6 and 5.7 alike). Here a
connection error from an ack or a reject on the consumer's current channel is raised again
in Celery's event loop, where Celery handles it as any lost connection: the consumer starts
again on a new connection, channel and prefetch credit, and consumes every queue it served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# A channel out of credit with a pool thread free is normal for a moment (an ack on its way);
# longer than this, the worker consumes nothing it should.
STALL_SECONDS = 5.0


class ConsumerWatch:
    """Thread-safe: the event loop writes it, the health server's thread reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._consumer: Any = None  # Celery's consumer while it is connected and consuming
        self._served: frozenset[str] = frozenset()  # the queues it consumed when first connected
        self._stalled_since: float | None = None

    def started(self, consumer: Any) -> None:
        """The consumer (re)connected and its task consumer is set up: watch its channel."""
        channel = consumer.task_consumer.channel
        for name in ("basic_ack", "basic_reject"):
            setattr(channel, name, _raising_in_loop(consumer, channel, getattr(channel, name)))
        with self._lock:
            self._consumer = consumer
            self._served = self._served or frozenset(_consuming(consumer))
            self._stalled_since = None

    def stopped(self) -> None:
        """The consumer lost its connection (or the worker is stopping)."""
        with self._lock:
            self._consumer = None

    def problem(self) -> str | None:
        """Why the worker takes no message it should right now; None while it consumes."""
        with self._lock:
            consumer = self._consumer
            if consumer is None:
                return "not connected to the broker"
            try:
                missing = sorted(self._served - set(_consuming(consumer)))
                stalled = _out_of_credit(consumer)
            except Exception:  # the consumer is reconnecting under us
                return "not connected to the broker"
            if missing:
                return f"not consuming {', '.join(missing)}"
            now = time.monotonic()
            if not stalled:
                self._stalled_since = None
                return None
            if self._stalled_since is None:
                self._stalled_since = now
            if now - self._stalled_since < STALL_SECONDS:
                return None
            return "the broker channel takes no message while a pool thread is free"


def _consuming(consumer: Any) -> list[str]:
    return [queue.name for queue in consumer.task_consumer.queues]


def _out_of_credit(consumer: Any) -> bool:
    """The channel's prefetch is spent on messages no task holds. (Only kombu's virtual
    transports keep the count in the client; AMQP's broker keeps it with the connection.)"""
    from celery.worker import state

    can_consume = getattr(getattr(consumer.task_consumer.channel, "qos", None), "can_consume", None)
    if not callable(can_consume) or can_consume():
        return False
    return len(state.active_requests) < consumer.pool.num_processes


def _raising_in_loop(consumer: Any, channel: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    errors = tuple(consumer.connection_errors)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except errors as exc:
            # An ack of a message from an earlier connection fails harmlessly: only the
            # current channel's failure means the consumer's connection is gone.
            task_consumer = consumer.task_consumer
            if consumer.hub is not None and task_consumer is not None and task_consumer.channel is channel:
                consumer.hub.call_soon(_raiser(exc))
            raise

    return call


def _raiser(exc: BaseException) -> Callable[[], None]:
    def reraise() -> None:
        raise exc

    return reraise
