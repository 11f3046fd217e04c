"""Kernel tests run on CPU in the Triton interpreter.

TRITON_INTERPRET is read when Triton decorates a kernel, i.e. when a ``kernels.*`` Triton
module is first imported, so it is set here at import time (a test module elsewhere that
imports the kernels earlier in the same process must see it set too: set it in the root
conftest or the environment). On a machine with a GPU run
``TRITON_INTERPRET=0 pytest tests/kernels`` to test the compiled kernels (bf16 cases are
enabled there; the interpreter computes bf16 wrongly).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import kernels.paged_attention as _pa  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1" and "Interpreted" not in type(_pa._paged_attn_kernel).__name__:
    raise RuntimeError(
        "kernels/ Triton modules were imported before TRITON_INTERPRET=1 was set, so they "
        "were compiled for a GPU; set TRITON_INTERPRET=1 earlier (root conftest or env)."
    )
