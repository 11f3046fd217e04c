"""What trying and measuring the engine needs beyond the engine itself: small random-weight models
of each family (``tiny_models``, ``python -m conveyor.testing.tiny_models``), ``make run``'s
example model (``example_model``) and what ``conveyor bench`` drives (``bench``). Tests,
benchmarks and those commands import it; the engine's runtime never does (only its command
line, ``python -m conveyor.engine --example``)."""
