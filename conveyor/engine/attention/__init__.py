"""Attention backends behind one interface, all over the same paged KV layout.

- ``base``: the interface (``AttentionBackend``) and one step's batch as a backend sees it
  (``AttentionMetadata``).
- ``torch_backend``: the CPU path, in plain torch.
- ``triton_backend``: the GPU path, through the Triton kernels in ``conveyor/kernels/``.
- ``selector``: ``create_backend``, which picks one by name (``auto``: ``triton`` on CUDA
  when Triton is installed, ``torch`` everywhere else).

Import each name from the module that defines it: this package re-exports nothing.
"""
