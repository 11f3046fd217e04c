"""The settings of the broker connection."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import MiB


class BrokerSettings(BaseModel):
    """Broker.

    The broker's transport options and timeouts, and the largest task message.
    """

    # Extra kombu transport options as JSON (an SQS region, a Redis global_keyprefix).
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    # The Redis/SQS visibility timeout: an unacknowledged message is delivered again after this long.
    broker_visibility_timeout: float = Field(3600.0, gt=0)
    # An AMQP broker that has not answered a call (a prefetch change, a queue declaration) for
    # this long is taken for gone: the call fails and the connection is made again. Without it a
    # broker that stops answering without closing the connection stalls a worker for good.
    broker_read_timeout: float = Field(60.0, gt=0, le=3600)
    # The largest task message a worker takes (a bigger one is refused and logged, not run).
    max_message_bytes: int = Field(1 * MiB, ge=1024)
