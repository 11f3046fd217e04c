"""Why a request's inputs were refused, with a code a result line can carry."""

from __future__ import annotations

# The codes ``InputRejected`` carries (besides the generic one).
PROMPT_TOO_LONG = "prompt_too_long"
GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
INVALID_REQUEST = "invalid_request"


class InputRejected(ValueError):
    """A request's inputs cannot be served: ``code`` says which kind of problem, the message
    names it. A ``ValueError``, as every bad-input error of the engine is."""

    def __init__(self, message: str, code: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


def error_code(exc: BaseException) -> str:
    """The code of a refusal: ``InputRejected``'s own, ``invalid_request`` for any other."""
    return exc.code if isinstance(exc, InputRejected) else INVALID_REQUEST
