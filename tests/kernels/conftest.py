"""Kernel tests run on CPU in the Triton interpreter.

The root conftest asks for the interpreter before anything imports triton (Triton reads
``TRITON_INTERPRET`` when it decorates a kernel, i.e. when a ``kernels.*`` Triton module is
first imported); this one checks that it took. On a machine with a GPU run with
``CONVEYOR_TEST_GPU=1`` (or ``TRITON_INTERPRET=0``) to test the compiled kernels (bf16 cases
are enabled there; the interpreter computes bf16 wrongly).
"""

import importlib

import pytest

from conveyor.kernels.interpreter import is_interpreting, kernels_interpreted

pytest.importorskip("triton")
# Imported now, so that kernels compiled in the wrong mode fail here, once, with a message.
importlib.import_module("conveyor.kernels.paged_attention")
if is_interpreting() and not kernels_interpreted():
    raise RuntimeError(
        "kernels/ Triton modules were imported before TRITON_INTERPRET=1 was set, so they "
        "were compiled for a GPU; set TRITON_INTERPRET=1 earlier (root conftest or env)."
    )
