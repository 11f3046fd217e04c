"""Embedding and scoring requests: ``PoolingParams``, the checkpoint's pooling config, the row hook
that pools a prompt's hidden states as its chunks run, and a text pair's relevance score."""
