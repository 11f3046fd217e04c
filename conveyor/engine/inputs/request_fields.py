"""A request's own fields, checked before its prompt is: its id, priority and deadline."""

from __future__ import annotations

import math

MAX_REQUEST_ID_CHARS = 256


def check_request_fields(request_id: object, priority: object, deadline: object) -> float | None:
    """``ValueError`` naming the first bad field; the deadline as a float (None: none)."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise ValueError(f"deadline must be a finite number of epoch seconds, got {deadline!r}")
    return float(deadline)
