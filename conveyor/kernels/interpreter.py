"""Triton's CPU interpreter: asking for it, and checking that it took.

Without a GPU the kernels run only in Triton's interpreter (slowly: for tests and
comparisons). Triton reads ``TRITON_INTERPRET`` when a jit function is *decorated*, that is
when the module defining it is first imported, and its own standard library is decorated
when ``triton`` is first imported. So the variable must be set before the process first
imports ``triton``: a process that imported it without the variable keeps compiled-mode jit
functions for good. Importing this module does not import Triton.
"""

from __future__ import annotations

import os
import sys

import torch

ENV_VAR = "TRITON_INTERPRET"
# The values Triton itself reads as true.
_TRUE = ("1", "true", "yes", "on", "y")


def is_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the interpreter."""
    return os.environ.get(ENV_VAR, "0").strip().lower() in _TRUE


def enable_interpreter(*, unless_set: bool = False) -> None:
    """Ask for the interpreter. It applies to jit functions decorated from now on, so call
    this before ``triton`` is first imported. ``unless_set``: leave an explicit setting as it
    is (``TRITON_INTERPRET=0`` to run the compiled kernels on a GPU)."""
    if not (unless_set and ENV_VAR in os.environ):
        os.environ[ENV_VAR] = "1"


def kernels_interpreted() -> bool:
    """True when Triton's jit functions really run in the interpreter: triton's own and, once
    imported, ours (``TRITON_INTERPRET`` was set before they were decorated)."""
    # Imported here, not at the top: Triton is optional, and importing it fixes its mode.
    import triton.language as tl

    std = getattr(tl, "cdiv", None)  # a jit function of triton's standard library
    if hasattr(std, "fn") and not _interpreted(std):
        return False
    module = sys.modules.get("conveyor.kernels.paged_attention")
    return module is None or _interpreted(module._paged_attn_kernel)


def kernel_device() -> str:
    """Where the Triton kernels run in this process: ``"cuda"`` (compiled) when there is a
    GPU and the interpreter is off, else ``"cpu"`` (in the interpreter)."""
    return "cuda" if torch.cuda.is_available() and not is_interpreting() else "cpu"


def _interpreted(fn: object) -> bool:
    return "Interpreted" in type(fn).__name__
