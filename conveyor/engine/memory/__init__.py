"""What requests hold in device memory: ``RequestMemory`` (the seam), the paged KV cache with its
block pool and prefix hashing, and a hybrid model's per-request state slots beside it."""
