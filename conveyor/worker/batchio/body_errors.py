"""The error a request body is rejected with, and how a user's value is shown in it (its own
module so that the modules for parts of a body can raise it without importing
``request_body``, which imports them)."""

from __future__ import annotations

import reprlib
from typing import Any


class InvalidRequest(ValueError):
    """A request the worker cannot run; ``code`` is machine-readable, ``param`` the field."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


_SHOWN = reprlib.Repr()  # bounded in length and depth: a value can be deeply nested
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 60, 60, 40


def shown(value: Any) -> str:
    """A short repr of a user's value for an error message."""
    return _SHOWN.repr(value)


__all__ = ["InvalidRequest", "shown"]
