"""Worker deaths, and the evidence they leave against poison items.

A worker that dies (killed, out of memory, a crashing kernel) cannot say why. Its shard's
lease expires and another worker takes the shard over; ``record_death`` runs in the very
transaction of that takeover (the sweeper's or ``acquire_lease``'s), so each death is
counted once:

- ``shards.deaths`` goes up. A shard with deaths runs its remaining items as suspects, in
  groups that halve with each death, one group at a time per process (the shard runner's
  quarantine lane), so a poison item soon runs alone.
- if the shard was running one item alone (``shards.solo_item``) and that item is not
  stored, ``item_crashes`` counts a crash against it: the one piece of evidence that an item
  kills its worker. Only an item with ``CONVEYOR_ITEM_MAX_CRASHES`` of those becomes an
  error; a death with many items in flight blames none of them.
"""

from __future__ import annotations

from sqlalchemy import exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from conveyor.worker.store.models import Item, ItemCrash, Shard, ShardStatus, now


def _this_shard(job_id: str, shard_index: int):
    return (Shard.job_id == job_id) & (Shard.shard_index == shard_index)


def record_death(conn: Connection, job_id: str, shard_index: int) -> str | None:
    """Count a death of the shard's holder (inside the takeover's transaction); returns the
    custom_id charged with a crash (the item it ran alone), if any."""
    row = conn.execute(select(Shard.solo_item, Shard.lease_owner).where(_this_shard(job_id, shard_index))).one_or_none()
    conn.execute(
        update(Shard)
        .where(_this_shard(job_id, shard_index))
        .values(deaths=Shard.deaths + 1, solo_item=None)
        .execution_options(synchronize_session=False)
    )
    if row is None or row.solo_item is None:
        return None
    stored = conn.execute(select(exists().where(Item.job_id == job_id, Item.custom_id == row.solo_item))).scalar_one()
    if stored:  # it finished before the death: not its fault
        return None
    values = {
        "job_id": job_id,
        "custom_id": row.solo_item,
        "shard_index": shard_index,
        "crashes": 1,
        "last_worker": row.lease_owner,
        "updated_at": now(),
    }
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(ItemCrash).values(**values)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["job_id", "custom_id"],
            set_={
                "crashes": ItemCrash.crashes + 1,
                "last_worker": stmt.excluded.last_worker,
                "updated_at": stmt.excluded.updated_at,
            },
        )
    )
    return row.solo_item


def set_solo_item(engine: Engine, job_id: str, shard_index: int, owner: str, custom_id: str | None) -> None:
    """Say which item the shard (held by ``owner``) runs alone from now on (None: a group)."""
    with engine.begin() as conn:
        conn.execute(
            update(Shard)
            .where(_this_shard(job_id, shard_index), Shard.status == ShardStatus.running, Shard.lease_owner == owner)
            .values(solo_item=custom_id)
            .execution_options(synchronize_session=False)
        )


def crash_counts(engine: Engine, job_id: str, shard_index: int) -> dict[str, int]:
    """custom_id -> deaths while it ran alone, for the shard's items that have any."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(ItemCrash.custom_id, ItemCrash.crashes).where(
                ItemCrash.job_id == job_id, ItemCrash.shard_index == shard_index
            )
        )
        return {custom_id: int(crashes) for custom_id, crashes in rows}
