"""A request's inputs made ready for the engine: tokenised, templated, its grammar compiled.

All of it is per line and can be slow on hostile input, so none of it has to run on the
thread that steps the engine: ``InputProcessor.prepare`` is thread-safe and gives a
``PreparedInput`` that ``LLMEngine.add_request`` takes as it is. Each phase has a budget and
its own error (``InputRejected.code``) that fails only that request.
"""
