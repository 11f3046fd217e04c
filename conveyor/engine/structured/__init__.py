"""Constraining what a request may generate: compiled grammars, per-request matchers and the
batch's token bitmask (``StructuredOutputs``), and the thinking gate of reasoning requests."""
