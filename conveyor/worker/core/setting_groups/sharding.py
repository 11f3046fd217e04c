"""The settings of sharding, leases and write batching."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import GiB, MiB


class ShardingSettings(BaseModel):
    """Sharding.

    Sharding, leases and write batching.
    """

    # Requests per shard when the submitter names no ``--shard-size``.
    shard_size: int = Field(256, ge=1)
    # How a job's lines are cut into shards when the submitter names no ``--shard-order``: ``prefix``
    # groups lines that share a prompt prefix (each shared document computed once), ``input`` keeps
    # consecutive runs of input lines.
    shard_order: Literal["prefix", "input"] = "prefix"
    # Memory (MiB) intake sorts a grouped job's lines in; beyond it, sorted runs go to temporary
    # files and are merged.
    prefix_sort_memory_mb: int = Field(256, ge=1)
    # How long a shard's lease lasts without a heartbeat before another worker may take it over.
    lease_seconds: float = Field(60.0, gt=0)
    # How often a worker renews its leases and its registry row (at most half of ``lease_seconds``).
    heartbeat_seconds: float = Field(10.0, gt=0)
    # Finished items written to the database per transaction, at most.
    item_commit_batch: int = Field(64, ge=1, le=10_000)
    # Finished items wait at most this long before they are written.
    item_commit_interval_seconds: float = Field(0.5, gt=0)
    # How often a running shard records its progress for ``status``.
    snapshot_interval_seconds: float = Field(5.0, gt=0)
    # The part size of multipart uploads of results files to S3 (5 MiB to 5 GiB, S3's bounds).
    multipart_part_bytes: int = Field(8 * MiB, ge=5 * MiB, le=5 * GiB)
