"""Tensor parallelism: one process per rank, each holding its shard of the weights and of
the KV cache (``parallel_state``: this process's rank and the collectives the layers use;
``sharding``: which rows or columns of a checkpoint tensor a rank takes; ``step_inputs``:
one step's batch packed for the broadcast; ``rank_group``: rank 0 starting, watching and
stopping the others; ``rank_worker``: what ranks 1..N-1 run)."""
