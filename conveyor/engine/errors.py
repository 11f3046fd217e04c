"""Errors that say more than their type: what the caller should do about them."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died, or a collective
    failed and left the ranks out of step). Requests in flight are lost; build a new engine."""
