"""Running a step's batch on the device: the model runner (build the batch, forward, sample), the
executors that call its forward pass (eager, CUDA graphs, tensor-parallel rank 0), the CUDA graph
buckets, and on CPU the thread count and its tuner."""
