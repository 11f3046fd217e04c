"""A grammar compiled first in a child process that is killed past its budget.

llguidance compiles some schemas superlinearly (a few hundred ``patternProperties`` take
minutes) and offers no way to stop a compile, so a thread cannot bound one. Before a
grammar is compiled in this process, a child compiles it with a deadline: past the deadline
the child is killed (and started again for the next grammar) and the request fails with
``grammar_too_complex``; within it, the grammar is known to compile in about that time.
Each thread that compiles has its own child, started on its first grammar.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from copy import copy
from pathlib import Path
from typing import Any

from conveyor.engine.inputs.errors import GRAMMAR_TOO_COMPLEX, InputRejected

_CHILD = Path(__file__).with_name("grammar_probe_child.py")
# How long a new child may take to build its tokenizer (a 150k vocabulary: about a second).
CHILD_START_SECONDS = 60.0


class GrammarProbe:
    """Children compiling grammars under a deadline, one per calling thread."""

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos: list[int] | None) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._n_vocab = n_vocab
        self._eos = eos
        self._header: str | None = None
        self._local = threading.local()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self.kills = 0  # children killed for running past a budget

    def check(self, grammar: str, budget_s: float, what: str) -> str | None:
        """The library's error for ``grammar`` (None: it compiles), found within ``budget_s``
        seconds; ``InputRejected(grammar_too_complex)`` when the compile takes longer."""
        child = self._child()
        try:
            return child.compile(grammar, budget_s)
        except TimeoutError:
            self._drop(child)
            with self._lock:
                self.kills += 1
            raise InputRejected(
                f"{what} takes longer than {budget_s:g} s to compile (CONVEYOR_GRAMMAR_COMPILE_SECONDS); "
                "simplify it (fewer patternProperties, alternatives or nested schemas)",
                GRAMMAR_TOO_COMPLEX,
            ) from None
        except (OSError, ValueError, EOFError) as exc:  # the child died or spoke garbage: start another
            self._drop(child)
            raise RuntimeError(f"the grammar compiler process failed: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, set()
        for child in children:
            child.kill()

    def _child(self) -> _Child:
        child: _Child | None = getattr(self._local, "child", None)
        if child is None or not child.alive():
            child = _Child(self._header_line())
            self._local.child = child
            with self._lock:
                self._children.add(child)
        return child

    def _drop(self, child: _Child) -> None:
        child.kill()
        self._local.child = None
        with self._lock:
            self._children.discard(child)

    def _header_line(self) -> str:
        if self._header is None:
            backend = copy(self._hf_tokenizer.backend_tokenizer)  # as llguidance.hf does
            backend.no_padding()
            backend.no_truncation()
            header = {"tokenizer": backend.to_str(), "n_vocab": self._n_vocab, "eos": self._eos}
            self._header = json.dumps(header) + "\n"
        return self._header


class _Child:
    def __init__(self, header: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-s", str(_CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._buffer = b""
        self._send(header)
        self._read_line(CHILD_START_SECONDS)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def compile(self, grammar: str, budget_s: float) -> str | None:
        self._send(json.dumps({"grammar": grammar}) + "\n")
        reply = json.loads(self._read_line(budget_s))
        error = reply.get("error")
        return None if error is None else str(error)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()

    def _send(self, text: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(text.encode())
        self._proc.stdin.flush()

    def _read_line(self, timeout_s: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError("the grammar compiler process exited")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line
